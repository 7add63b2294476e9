"""`ssl-xcit export` to ONNX and torch.export: the program read back from disk (onnxruntime on CPU,
``torch.export.load``) gives PyTorch's embedding within 1e-4 relative, at two batch sizes and three resolutions,
for every family; the format comes from the extension or ``--format``; every file is atomic and follows the umask.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from ssl_xcit.cli.export import main as export_main
from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model
from ssl_xcit.models import export as formats

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

FAMILIES = [
    ("xcit_nano_12_p16", {"depth": 1}),
    ("cait_xxs24", {"depth": 1}),
    ("vit_small_patch16_224", {"depth": 1}),
    ("crossformerpp_small", {"depths": (1, 1, 1, 1)}),
    ("bixt_ti_l64_p16", {"depth": 2}),
]
# XCiT and ViT run in the default suite; the other families' traces take 5-15 s each and run with -m slow.
DYNAMIC = [
    # ViT by default (the suite's time budget); XCiT and the others with -m slow (~10 s each)
    case if case[0].startswith("vit") else pytest.param(*case, marks=pytest.mark.slow)
    for case in FAMILIES
    if not case[0].startswith("crossformerpp")
]
# (batch, height, width): two batch sizes, three resolutions; the largest has more tokens than XCiT-N has
# channels (196 > 128), where XCiT's attention takes its other branch in eager mode.
SIZES = [(1, 64, 64), (3, 96, 128), (1, 224, 224)]


def _model(name, kwargs):
    torch.manual_seed(0)
    return create_model(name, **kwargs).eval()


def _relative(got, want) -> float:
    got = torch.as_tensor(np.asarray(got))
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def _compare(model, run, sizes) -> float:
    worst = 0.0
    for batch, height, width in sizes:
        x = torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            want = model(x)
        got = run(x)
        assert tuple(got.shape) == tuple(want.shape)
        worst = max(worst, _relative(got, want))
    return worst


def _onnx_run(path):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    return lambda x: session.run(None, {"images": x.numpy()})[0]


def _pt2_run(path):
    module = torch.export.load(str(path)).module()
    return lambda x: module(x).detach()


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
@pytest.mark.parametrize("name,kwargs", DYNAMIC)
def test_onnx_matches_pytorch_at_two_batches_and_resolutions(tmp_path, name, kwargs):
    model = _model(name, kwargs)
    path, checked = formats.export_onnx(model, tmp_path / "b.onnx", resolution=64)
    assert checked is not None and checked <= formats.CHECK_TOLERANCE
    error = _compare(model, _onnx_run(path), SIZES)
    print(f"ONNX {name}: max relative error {error:.2e}")
    assert error < 1e-4


@pytest.mark.parametrize("name,kwargs", DYNAMIC)
def test_pt2_matches_pytorch_at_two_batches_and_resolutions(tmp_path, name, kwargs):
    model = _model(name, kwargs)
    path, _ = formats.export_pt2(model, tmp_path / "b.pt2", resolution=64)
    error = _compare(model, _pt2_run(path), SIZES)
    print(f"pt2 {name}: max relative error {error:.2e}")
    assert error < 1e-4


@pytest.mark.parametrize(
    "resolution", [64, pytest.param(96, marks=pytest.mark.slow)]
)  # a second full ONNX export of CrossFormer++ (~10 s) runs with -m slow
# ~7 s each; the default suite exports XCiT and ViT with a dynamic batch (test_pt2_matches_pytorch_*)
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.slow) for f in ("onnx", "pt2")])
def test_crossformerpp_exports_one_resolution_with_a_dynamic_batch(tmp_path, fmt, resolution):
    model = _model(*FAMILIES[3])
    with pytest.raises(UserError, match=r"crossformerpp_small cannot be exported with a dynamic resolution: .*"
                       r"feature-map size.*--fixed-resolution"):  # fmt: skip
        getattr(formats, f"export_{fmt}")(model, tmp_path / f"b.{fmt}", resolution=resolution)
    assert list(tmp_path.iterdir()) == []
    path, _ = getattr(formats, f"export_{fmt}")(
        model, tmp_path / f"b.{fmt}", resolution=resolution, fixed_resolution=True
    )
    run = _onnx_run(path) if fmt == "onnx" else _pt2_run(path)
    error = _compare(model, run, [(1, resolution, resolution), (3, resolution, resolution)])
    print(f"{fmt} crossformerpp_small at {resolution}: max relative error {error:.2e}")
    assert error < 1e-4
    # The eager model still runs after the trace (a cached fake tensor would break it).
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 96))


def _dino_checkpoint(path, name="xcit_nano_12_p16", kwargs=None):
    kwargs = {"depth": 1} if kwargs is None else kwargs
    model = _model(name, kwargs)
    state = {f"teacher.backbone.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"backbone": name, "backbone_kwargs": kwargs}}, path)
    return model


def test_the_format_follows_the_extension_or_the_flag(tmp_path, capsys):
    _dino_checkpoint(tmp_path / "run.ckpt")
    ckpt = str(tmp_path / "run.ckpt")
    assert export_main([ckpt, str(tmp_path / "a.safetensors")])["format"] == "safetensors"
    assert export_main([ckpt, str(tmp_path / "a.pt")])["format"] == "pth"
    assert export_main([ckpt, str(tmp_path / "a.PTH")])["format"] == "pth"
    assert (
        export_main([ckpt, str(tmp_path / "weights.bin"), "--format", "safetensors"])["format"]
        == "safetensors"
    )
    assert (tmp_path / "weights.bin").read_bytes()[8:9] == b"{"  # a safetensors header, not a zip
    with pytest.raises(SystemExit) as stop:
        export_main([ckpt, str(tmp_path / "teacher.bin")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert "'.bin'" in err and ".safetensors, .pth, .pt, .onnx, .pt2" in err and "--format" in err
    assert not (tmp_path / "teacher.bin").exists()
    with pytest.raises(UserError, match=r"unknown export format 'tflite'; valid formats: safetensors, pth"):
        formats.resolve_format("x.onnx", "tflite")


def test_onnx_through_the_command_names_what_it_checked(tmp_path, capsys):
    model = _dino_checkpoint(tmp_path / "run.ckpt", "vit_small_patch16_224")
    result = export_main([str(tmp_path / "run.ckpt"), str(tmp_path / "teacher.onnx"), "--resolution", "32"])
    out = capsys.readouterr().out
    assert result == {
        "out": str(tmp_path / "teacher.onnx"),
        "model": "vit_small_patch16_224",
        "format": "onnx",
    }
    assert "dynamic batch and resolution, traced at 32x32; max relative difference to PyTorch" in out
    assert _compare(model, _onnx_run(tmp_path / "teacher.onnx"), [(2, 32, 48)]) < 1e-4
    with pytest.raises(SystemExit):
        export_main([str(tmp_path / "run.ckpt"), str(tmp_path / "x.onnx"), "--resolution", "40"])
    assert "--resolution 40 does not fit vit_small_patch16_224: it must be a positive multiple of 16" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_a_program_that_differs_from_pytorch_is_not_written(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(formats, "CHECK_TOLERANCE", -1.0)  # every program now counts as wrong
    model = _model("vit_small_patch16_224", {"depth": 1})
    with pytest.raises(UserError, match=r"differs from PyTorch by .*relative; tolerance -1\); not written"):
        getattr(formats, f"export_{fmt}")(model, tmp_path / f"b.{fmt}", resolution=32)
    assert list(tmp_path.iterdir()) == []  # no file and no temporary left


@pytest.fixture(params=[False, True], ids=["umask", "SSL_XCIT_PRIVATE=1"])
def private(request, monkeypatch):
    if request.param:
        monkeypatch.setenv("SSL_XCIT_PRIVATE", "1")
    else:
        monkeypatch.delenv("SSL_XCIT_PRIVATE", raising=False)
    old = os.umask(0o027)
    yield request.param
    os.umask(old)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", ".onnx", ".pt2"])
def test_every_format_follows_the_umask(private, tmp_path, suffix):
    _dino_checkpoint(tmp_path / "run.ckpt", "vit_small_patch16_224")
    out = tmp_path / "exports" / f"teacher{suffix}"
    export_main([str(tmp_path / "run.ckpt"), str(out), "--resolution", "32"])
    assert stat.S_IMODE(out.stat().st_mode) == (0o600 if private else 0o640)
    assert stat.S_IMODE(out.parent.stat().st_mode) == (0o700 if private else 0o750)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # the temporary was renamed, not left


class _BranchOnSize(torch.nn.Module):
    """A network whose eager code branches on the token count: traced at one size, a program holds for one side
    of the branch only (what XCiT's attention did before it took one path under torch.export)."""

    name, family, size_multiple = "branchy", "test", 16

    def forward(self, x):
        pooled = x.mean((2, 3))
        return pooled * 2 if x.shape[-1] * x.shape[-2] > 80 * 80 else pooled


@pytest.mark.parametrize("fmt,message", [
    ("onnx", r"the ONNX program differs from PyTorch by"),
    ("pt2", r"branchy cannot be exported with torch.export: Guard failed"),
])  # fmt: skip
def test_the_check_catches_a_program_traced_down_one_branch(tmp_path, fmt, message):
    with pytest.raises(UserError, match=message):
        getattr(formats, f"export_{fmt}")(_BranchOnSize(), tmp_path / f"b.{fmt}", resolution=96)
    assert list(tmp_path.iterdir()) == []
