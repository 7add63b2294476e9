"""``ssl-xcit export CKPT OUT``: the teacher backbone of a DINO checkpoint, in the format OUT's extension names.

``.safetensors`` (the recommended format) and ``.pth`` hold the state dict in the family's timm parameter
names (no prefix, no DINO head) and the recipe that rebuilds the network (registered name and
``backbone_kwargs``): ``build_backbone(out)`` rebuilds the exact architecture (non-default options such as
``tokens_norm`` or a truncated ``depth`` included) and the matching timm model loads the state dict with
``strict=True``. ``.onnx`` and ``.pt2`` are traced programs for running the backbone outside this package
(``ssl_xcit.models.export``). The teacher is exported because it is the better network (the DINO authors
corrected their first XCiT backbone releases from student to teacher weights, dino#79).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ssl_xcit.errors import UserError
from ssl_xcit.models.sharded import is_checkpoint
from ssl_xcit.utils.io import atomic_torch_save, owner_only

TEACHER_PREFIX = "teacher.backbone."
STUDENT_PREFIX = "student.backbone."
STUDENT_EMA_PREFIX = "student_ema.backbone."  # a dinov3 distillation's evaluated network


def teacher_backbone_state(checkpoint: dict[str, Any], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """``teacher.backbone.*`` of a Lightning DINO checkpoint, prefix removed; for a distillation checkpoint
    (``ssl_xcit.dino.distill``), which saves no teacher (its frozen teacher is an input), the product:
    ``student_ema.backbone.*`` (the dinov3 objective) or else ``student.backbone.*``."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        keys = list(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise UserError(f"{source} is not a Lightning checkpoint (no 'state_dict'); top-level keys: {keys}")
    prefix = next(
        (p for p in (TEACHER_PREFIX, STUDENT_EMA_PREFIX) if any(k.startswith(p) for k in state)),
        STUDENT_PREFIX,
    )
    out = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not out:
        prefixes = sorted({k.split(".")[0] for k in state})
        raise UserError(
            f"{source} has no teacher backbone (no '{TEACHER_PREFIX}*' keys; top-level modules: {prefixes}); "
            "export needs a checkpoint of ssl_xcit.dino.module.DINO"
        )
    return out


def teacher_backbone(
    checkpoint_path: str | Path, materialize: bool = True
) -> tuple[torch.nn.Module, str, dict[str, Any]]:
    """The teacher backbone of a DINO checkpoint, built from its recorded name and ``backbone_kwargs`` and
    loaded strictly (so a bad export never lands); returns (model, name, architecture kwargs). With
    ``materialize`` false the model is built on the meta device and takes the checkpoint's tensors themselves
    (cast to the model's dtypes): no second copy of the weights, for writing its state dict out (buffers the
    state dict leaves out stay on the meta device). A sharded folder is read for that backbone alone."""
    from ssl_xcit.models import create_model
    from ssl_xcit.models.checkpoint import read_backbone_checkpoint

    checkpoint_path = Path(checkpoint_path)
    if not is_checkpoint(checkpoint_path):  # a file, or a folder of FSDP2 shards
        raise FileNotFoundError(f"checkpoint {checkpoint_path} does not exist")
    checkpoint = read_backbone_checkpoint(checkpoint_path)
    state = teacher_backbone_state(checkpoint, str(checkpoint_path))
    hparams = checkpoint.get("hyper_parameters") or {}
    name = hparams.get("backbone")
    if not isinstance(name, str):
        raise UserError(f"{checkpoint_path} does not record its backbone name (hyper_parameters['backbone'])")
    kwargs = dict(hparams.get("backbone_kwargs") or {})
    # iBOT's mask token is a training input, not part of the network one evaluates: the export leaves it out.
    state.pop("mask_token", None)
    if materialize:
        model = create_model(name, **kwargs)
        model.load_state_dict(state, strict=True)
    else:
        model = create_model(name, device="meta", **kwargs)
        own = model.state_dict()
        state = {k: v.to(own[k].dtype) if k in own else v for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
    # Only the architecture arguments: training-time ones (drop_path_rate) do not describe the weights.
    arch = {k: v for k, v in kwargs.items() if k != "drop_path_rate"}
    return model.eval(), model.name, arch


def export_teacher(
    checkpoint_path: str | Path,
    out_path: str | Path,
    fmt: str | None = None,
    resolution: int = 224,
    fixed_resolution: bool = False,
) -> tuple[Path, str]:
    """Write the teacher backbone of ``checkpoint_path`` to ``out_path`` (atomically) in ``fmt`` (default:
    the format of ``out_path``'s extension); returns (path, model name). ``resolution`` and
    ``fixed_resolution`` set the example input of the ONNX and pt2 programs (see ``ssl_xcit.models.export``)."""
    from ssl_xcit.models import export as formats

    fmt = formats.resolve_format(out_path, fmt)
    path, name, _ = _export(checkpoint_path, out_path, fmt, resolution, fixed_resolution)
    return path, name


def _export(
    checkpoint_path: str | Path, out_path: str | Path, fmt: str, resolution: int, fixed_resolution: bool
) -> tuple[Path, str, str]:
    from ssl_xcit.models import export as formats

    weights_only = fmt in ("safetensors", "pth")
    model, name, arch = teacher_backbone(checkpoint_path, materialize=not weights_only)
    private = owner_only()
    if weights_only:
        plain = _plain(model.state_dict())
        if fmt == "safetensors":
            return formats.save_safetensors(plain, name, arch, out_path, private=private), name, ""
        record = {"state_dict": plain, "hyper_parameters": {"backbone": name, "backbone_kwargs": arch}}
        return atomic_torch_save(record, out_path, private=private), name, ""
    writer = formats.export_onnx if fmt == "onnx" else formats.export_pt2
    path, error = writer(model, out_path, resolution, fixed_resolution, private=private)
    dims = "batch" if fixed_resolution else "batch and resolution"
    check = (
        "not checked: onnxruntime is not installed"
        if error is None
        else f"max relative difference to PyTorch {error:.1e}"
    )
    return path, name, f"; dynamic {dims}, traced at {resolution}x{resolution}; {check}"


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain contiguous CPU tensors, in the model's own key order, each owning its storage (safetensors
    refuses shared storages, and torch.save would write a view's whole storage); a tensor that already does is
    kept, not copied, so the export holds the weights once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state.items():
        value = value.detach().cpu().contiguous()
        storage = value.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != value.nbytes:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        out[key] = value
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    from ssl_xcit.models.export import EXTENSIONS, FORMATS, resolve_format

    parser = argparse.ArgumentParser(
        prog="ssl-xcit export",
        description="Export the teacher backbone of a DINO checkpoint: safetensors (timm-compatible state dict "
        "+ the recipe that rebuilds it; the recommended format), .pth, ONNX or a torch.export program (.pt2).",
    )
    parser.add_argument(
        "checkpoint",
        help="Lightning checkpoint of a DINO run (e.g. runs/quickstart/version_0/checkpoints/last.ckpt)",
    )
    parser.add_argument(
        "out",
        help=f"output file, written atomically; its extension ({', '.join(EXTENSIONS)}) picks the format",
    )
    parser.add_argument("--format", choices=FORMATS, help="the format, whatever OUT's extension")
    parser.add_argument(
        "--resolution", type=int, default=224, help="image side the ONNX/pt2 program is traced and checked at"
    )
    parser.add_argument(
        "--fixed-resolution",
        action="store_true",
        help="ONNX/pt2: only --resolution is accepted (needed for CrossFormer++ and the DINOv3 ViTs); the batch stays dynamic",
    )
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        fmt = resolve_format(args.out, args.format)
        path, name, detail = _export(args.checkpoint, args.out, fmt, args.resolution, args.fixed_resolution)
    except (FileNotFoundError, UserError) as err:
        parser.exit(2, f"ssl-xcit export: error: {err}\n")
    print(f"exported the backbone ({name}) of {args.checkpoint} to {path} ({fmt}{detail})")
    return {"out": str(path), "model": name, "format": fmt}
