"""Writing a backbone in the formats other tools read: safetensors, a torch ``.pth``, ONNX and ``torch.export``.

* **safetensors** (the default): the state dict in timm's parameter names, plus the recipe that rebuilds the
  network in the file's metadata (``backbone``: the registered name; ``backbone_kwargs``: a JSON object;
  ``timm_model``: timm's name of the architecture, for the families timm has). The format holds tensors and
  strings only, so reading it cannot run code, and timm loads it natively.
* **pth**: ``{"state_dict": ..., "hyper_parameters": {"backbone", "backbone_kwargs"}}`` through ``torch.save``.
* **onnx**: the dynamo exporter (onnxscript); input ``images`` (B, 3, H, W), output ``embedding`` (B, D).
* **pt2**: ``torch.export.export`` + ``torch.export.save``; ``torch.export.load(path).module()`` runs it.

ONNX and pt2 have a dynamic batch size and, for every family but CrossFormer++, a dynamic resolution. Before a
program is written it is run against PyTorch on one and two images (and at a second resolution when it is
dynamic); a program off by more than :data:`CHECK_TOLERANCE` (relative) is not written. Every file is written
atomically (``ssl_xcit.utils.io``) and follows the umask.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssl_xcit.errors import UserError
from ssl_xcit.utils.io import atomic_write

# Extension -> format; the first extension of a format is the one its help names.
EXTENSIONS = {".safetensors": "safetensors", ".pth": "pth", ".pt": "pth", ".onnx": "onnx", ".pt2": "pt2"}
FORMATS = ("safetensors", "pth", "onnx", "pt2")
CHECK_TOLERANCE = 1e-4  # max |exported - PyTorch| / max |PyTorch| over the check inputs

# Families whose exported graph holds for one resolution only, and why (a one-line UserError names it).
STATIC_RESOLUTION = {
    "crossformerpp": "its attention groups tokens into windows whose layout and padding mask are chosen from the "
    "feature-map size, so one graph holds for one resolution",
    "dinov3": "timm builds RoPE's sine and cosine tables from the patch grid's size as Python numbers, so one "
    "graph holds for one resolution",
}

SAFETENSORS_NAME_KEY = "backbone"
SAFETENSORS_KWARGS_KEY = "backbone_kwargs"
SAFETENSORS_TIMM_KEY = "timm_model"


def timm_name(name: str) -> str | None:
    """timm's name of the registered model ``name`` (XCiT and CaiT carry timm's ``_224`` there), or ``None``
    for the families timm does not have (CrossFormer++, BiXT)."""
    import timm

    family = name.split("_", 1)[0]
    if family not in ("xcit", "cait", "vit", "convnext"):  # timm's parameter names (DINOv3's ViTs are vit_*)
        return None
    return next((n for n in (name, f"{name}_224") if timm.is_model(n)), None)


def resolve_format(out: str | os.PathLike, fmt: str | None = None) -> str:
    """``fmt`` if given (checked), else the format named by ``out``'s extension; a one-line UserError otherwise."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UserError(f"unknown export format {fmt!r}; valid formats: {', '.join(FORMATS)}")
        return fmt
    suffix = Path(out).suffix.lower()
    if suffix not in EXTENSIONS:
        valid = ", ".join(EXTENSIONS)
        raise UserError(
            f"cannot tell the export format of {out} from its extension {suffix or '(none)'!r}: use one of "
            f"{valid}, or pass --format {{{','.join(FORMATS)}}}"
        )
    return EXTENSIONS[suffix]


# ----------------------------------------------------------------------------------------------- safetensors


def _tuples(value: Any) -> Any:
    """JSON turns tuples into lists; the recorded kwargs come back as the tuples the recipe gave."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def save_safetensors(
    state: dict[str, Tensor],
    name: str,
    kwargs: dict[str, Any],
    path: str | os.PathLike,
    private: bool = False,
) -> Path:
    """``state`` as safetensors with ``name`` and ``kwargs`` (JSON) in its metadata, written atomically."""
    from safetensors.torch import save_file

    try:
        recipe = json.dumps(kwargs, sort_keys=True)
    except TypeError as error:
        raise UserError(
            f"the backbone_kwargs of {name} ({kwargs}) cannot be written as JSON for the safetensors metadata "
            f"({error}); export with --format pth instead"
        ) from error
    # "format": "pt" is the tag Hugging Face loaders check for PyTorch tensors.
    metadata = {"format": "pt", SAFETENSORS_NAME_KEY: name, SAFETENSORS_KWARGS_KEY: recipe}
    if (timm_model := timm_name(name)) is not None:
        metadata[SAFETENSORS_TIMM_KEY] = timm_model
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with atomic_write(path, "wb", private=private) as handle:
        # save_file writes each tensor from its own memory (save() would first build the whole file in
        # memory), to a file it names itself: staged in a folder only we can enter, then copied into place.
        with tempfile.TemporaryDirectory(dir=Path(path).parent, prefix=".safetensors.") as staging:
            staged = Path(staging) / "out.safetensors"
            save_file(tensors, str(staged), metadata=metadata)
            with open(staged, "rb") as source:
                shutil.copyfileobj(source, handle, 1 << 24)
    return Path(path)


def is_safetensors(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file: by extension, or by its header (an 8-byte little-endian length,
    then a JSON object), so a renamed file is recognised too."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        return True
    with open(path, "rb") as handle:
        head = handle.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return int.from_bytes(head[:8], "little") <= path.stat().st_size - 8


def read_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """A safetensors file as a checkpoint: ``{"state_dict", "hyper_parameters"}`` when its metadata records the
    backbone (files of ``ssl-xcit export``), else the plain tensor dict (e.g. timm's ``model.safetensors``)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        state = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise UserError(f"cannot read safetensors file {path}: {error}") from error
    name = metadata.get(SAFETENSORS_NAME_KEY)
    if not name:
        return state
    try:
        kwargs = _tuples(json.loads(metadata.get(SAFETENSORS_KWARGS_KEY) or "{}"))
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: its metadata '{SAFETENSORS_KWARGS_KEY}' is not JSON ({error})") from error
    return {"state_dict": state, "hyper_parameters": {"backbone": name, "backbone_kwargs": kwargs}}


# ------------------------------------------------------------------------------------------------ programs


def _check_inputs(model: nn.Module, resolution: int, dynamic_resolution: bool) -> list[Tensor]:
    """One and two images at ``resolution``; with a dynamic resolution also a non-square size of about half the
    tokens, so a branch taken on the token count while tracing shows up as a refused or wrong program."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, 3, resolution, resolution), (2, 3, resolution, resolution)]
    if dynamic_resolution:
        step = getattr(model, "size_multiple", 16)
        half = max(2 * step, resolution // 2 // step * step)
        shapes.append((2, 3, half, resolution + 2 * step))
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def _relative_error(got: Tensor, want: Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12))


def _checked(model: nn.Module, run: Any, inputs: list[Tensor], label: str) -> float:
    """Max relative error of ``run`` against ``model`` over ``inputs``; a UserError above the tolerance."""
    worst = 0.0
    for x in inputs:
        with torch.no_grad():
            want = model(x)
        with torch.no_grad():
            got = torch.as_tensor(run(x)).detach()
        if got.shape != want.shape:
            raise UserError(
                f"the {label} gives shape {tuple(got.shape)} for {tuple(x.shape)}, PyTorch {tuple(want.shape)}"
            )
        worst = max(worst, _relative_error(got, want))
    if worst > CHECK_TOLERANCE:
        raise UserError(
            f"the {label} differs from PyTorch by {worst:.2e} (relative; tolerance {CHECK_TOLERANCE:g}); not written"
        )
    return worst


def _dynamic_shapes(dynamic_resolution: bool) -> tuple[dict[int, Any]]:
    from torch.export import Dim

    dims = {0: Dim.DYNAMIC}
    if dynamic_resolution:
        dims |= {2: Dim.DYNAMIC, 3: Dim.DYNAMIC}
    return (dims,)


def check_resolution(model: nn.Module, resolution: int, fixed_resolution: bool) -> bool:
    """Whether the program gets a dynamic resolution; a UserError for a family that cannot have one, or for a
    resolution the model does not take."""
    name, family = getattr(model, "name", type(model).__name__), getattr(model, "family", "")
    step = getattr(model, "size_multiple", 1)
    if resolution <= 0 or resolution % step:
        raise UserError(
            f"--resolution {resolution} does not fit {name}: it must be a positive multiple of {step}"
        )
    if fixed_resolution:
        return False
    if family in STATIC_RESOLUTION:
        raise UserError(
            f"{name} cannot be exported with a dynamic resolution: {STATIC_RESOLUTION[family]}; pass "
            f"--fixed-resolution to export it for {resolution}x{resolution} (set by --resolution)"
        )
    return True


@contextlib.contextmanager
def _quiet() -> Any:
    """The exporters print progress lines; the command prints one summary instead (and the lines on error)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    except Exception:
        print(buffer.getvalue(), end="")
        raise


def export_onnx(
    model: nn.Module, path: str | os.PathLike, resolution: int = 224, fixed_resolution: bool = False,
    private: bool = False,
) -> tuple[Path, float | None]:  # fmt: skip
    """``model`` as ONNX (dynamo exporter), written atomically; returns (path, max relative error against
    PyTorch, or ``None`` when onnxruntime is not installed to check it)."""
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError as error:
            raise UserError(
                f"ONNX export needs the '{package}' package: pip install 'ssl-xcit[export]' (onnx, onnxscript, "
                "onnxruntime)"
            ) from error
    dynamic = check_resolution(model, resolution, fixed_resolution)
    model = model.eval()
    example = torch.randn(2, 3, resolution, resolution, generator=torch.Generator().manual_seed(0))
    try:
        with _quiet(), torch.no_grad():
            program = torch.onnx.export(
                model, (example,), dynamo=True, dynamic_shapes=_dynamic_shapes(dynamic),
                input_names=["images"], output_names=["embedding"], verbose=False,
            )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - the exporter's many error types, reported in one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"{getattr(model, 'name', 'the model')} cannot be exported to ONNX: {first}"
        ) from error
    data = program.model_proto.SerializeToString()
    error = None
    try:
        import onnxruntime
    except ImportError:
        onnxruntime = None
    if onnxruntime is not None:
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        error = _checked(
            model, lambda x: session.run(None, {"images": x.numpy()})[0],
            _check_inputs(model, resolution, dynamic), "ONNX program",
        )  # fmt: skip
    with atomic_write(path, "wb", private=private) as handle:
        handle.write(data)
    return Path(path), error


def _export_program(model: nn.Module, example: Tensor, dynamic: bool, oblivious: bool) -> Any:
    import torch.fx.experimental._config as fx_config

    # torch 2.6 has no backed_size_oblivious: there the second try traces as the first.
    option = {"backed_size_oblivious": oblivious} if hasattr(fx_config, "backed_size_oblivious") else {}
    with torch.no_grad(), fx_config.patch(**option):
        return torch.export.export(model, (example,), dynamic_shapes=_dynamic_shapes(dynamic))


def export_pt2(
    model: nn.Module, path: str | os.PathLike, resolution: int = 224, fixed_resolution: bool = False,
    private: bool = False,
) -> tuple[Path, float]:  # fmt: skip
    """``model`` as a ``torch.export`` program (``.pt2``), written atomically; returns (path, max relative
    error against PyTorch)."""
    dynamic = check_resolution(model, resolution, fixed_resolution)
    model = model.eval()
    example = torch.randn(2, 3, resolution, resolution, generator=torch.Generator().manual_seed(0))
    inputs = _check_inputs(model, resolution, dynamic)
    failure: Exception | None = None
    # Traced on two images, a program can keep a guard that holds for batch >= 2 only (CaiT's reshapes);
    # tracing again with size-oblivious sizes drops it. The check decides which one is written.
    for oblivious in (False, True):
        try:
            program = _export_program(model, example, dynamic, oblivious)
            error = _checked(model, program.module(), inputs, "torch.export program")
        except Exception as caught:  # noqa: BLE001 - retried once, then reported in one line
            failure = caught
            continue
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        with atomic_write(path, "wb", private=private) as handle:
            handle.write(buffer.getvalue())
        return Path(path), error
    assert failure is not None
    if isinstance(failure, UserError):
        raise failure
    first = str(failure).strip().splitlines()[0] if str(failure).strip() else type(failure).__name__
    raise UserError(
        f"{getattr(model, 'name', 'the model')} cannot be exported with torch.export: {first}"
    ) from failure
