"""``.safetensors`` wherever weights are read: ``read_checkpoint``, ``load_pretrained`` and ``build_backbone``,
with the recipe from the metadata of ``ssl-xcit export``, or inferred from the shapes of a plain file (timm's)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ssl_xcit.errors import UserError
from ssl_xcit.models import build_backbone, create_model, load_pretrained, read_checkpoint
from ssl_xcit.models.export import is_safetensors, save_safetensors


def _model(name, **kwargs):
    torch.manual_seed(0)
    return create_model(name, **kwargs).eval()


def _same_outputs(a, b, size=(1, 3, 64, 96)):
    x = torch.randn(*size)
    with torch.no_grad():
        torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=0, atol=0)


def test_the_recipe_rides_in_the_metadata(tmp_path):
    model = _model("crossformerpp_small", depths=(1, 1, 1, 1))
    path = save_safetensors(
        model.state_dict(), model.name, {"depths": (1, 1, 1, 1)}, tmp_path / "w.safetensors"
    )
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["backbone"] == "crossformerpp_small" and metadata["format"] == "pt"
    assert json.loads(metadata["backbone_kwargs"]) == {"depths": [1, 1, 1, 1]}  # string -> string JSON
    record = read_checkpoint(path)
    # JSON's lists come back as the tuples the recipe gave, so a .safetensors and a .pth record read alike.
    assert record["hyper_parameters"] == {
        "backbone": "crossformerpp_small",
        "backbone_kwargs": {"depths": (1, 1, 1, 1)},
    }
    assert record["state_dict"].keys() == model.state_dict().keys()
    rebuilt = build_backbone(path)
    assert rebuilt.name == "crossformerpp_small"
    _same_outputs(rebuilt, model)


def test_a_plain_safetensors_file_is_recognised_by_its_shapes(tmp_path):
    # A timm-style model.safetensors: tensors only, no recipe; the variant is inferred as for a .pth.
    model = _model("xcit_nano_12_p16")
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    rebuilt = build_backbone(tmp_path / "model.safetensors")
    assert rebuilt.name == "xcit_nano_12_p16"
    _same_outputs(rebuilt, model)
    fresh = create_model("xcit_nano_12_p16")
    report = load_pretrained(fresh, str(tmp_path / "model.safetensors"))
    assert report.missing == [] and report.unexpected == []
    _same_outputs(fresh, model)
    with pytest.raises(UserError, match=r"holds a xcit_nano_12_p16 backbone, but cait_xxs24 was requested"):
        build_backbone(tmp_path / "model.safetensors", "cait_xxs24")


def test_a_renamed_safetensors_file_is_read_by_its_header(tmp_path):
    model = _model("vit_small_patch16_224", depth=1)
    save_safetensors(model.state_dict(), model.name, {"depth": 1}, tmp_path / "teacher.bin")
    assert is_safetensors(tmp_path / "teacher.bin")
    torch.save(model.state_dict(), tmp_path / "teacher.pth")
    assert not is_safetensors(tmp_path / "teacher.pth")  # a torch zip is not taken for one
    _same_outputs(build_backbone(tmp_path / "teacher.bin"), model, (2, 3, 32, 32))


def test_safetensors_needs_no_trust_and_a_broken_one_is_named(tmp_path):
    model = _model("xcit_nano_12_p16", depth=1)
    path = save_safetensors(model.state_dict(), model.name, {"depth": 1}, tmp_path / "w.safetensors")
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"cannot read safetensors file .*cut\.safetensors"):
        build_backbone(tmp_path / "cut.safetensors")
    assert load_file(str(path)).keys() == model.state_dict().keys()


@pytest.mark.parametrize(
    "suffix,what", [(".onnx", "an ONNX model"), (".pt2", "a torch.export program")]
)  # fmt: skip
def test_a_program_is_not_taken_for_weights(tmp_path, suffix, what):
    path = tmp_path / f"teacher{suffix}"
    path.write_bytes(b"not weights")
    with pytest.raises(UserError, match=rf"teacher\{suffix} is {what}, a traced program rather than weights: "
                       r"pass the \.safetensors \(or \.pth\)"):  # fmt: skip
        build_backbone(path)
