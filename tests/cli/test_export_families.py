"""`ssl-xcit export` records the model name and backbone_kwargs (.safetensors metadata or the .pth record);
build_backbone rebuilds from them (every family); timm's model of the same name loads the file strictly."""

from __future__ import annotations

import pytest
import torch

from ssl_xcit.cli.export import main as export_main
from ssl_xcit.models import build_backbone, create_model, read_checkpoint

CASES = [
    ("xcit_nano_12_p16", {"depth": 1, "tokens_norm": True}),  # nano's default is tokens_norm=False
    ("cait_xxs24", {"depth": 1}),
    ("vit_small_patch16_224", {"depth": 1}),
    pytest.param("crossformerpp_small", {"depths": (1, 1, 1, 1)}, marks=pytest.mark.slow),  # ~5 s a build
    ("bixt_ti_l64_p16", {"depth": 2}),
]


def _fake_dino_checkpoint(path, name, kwargs):
    torch.manual_seed(0)
    teacher, student = create_model(name, **kwargs), create_model(name, **kwargs)
    state = {f"teacher.backbone.{k}": v for k, v in teacher.state_dict().items()}
    state |= {f"student.backbone.{k}": v for k, v in student.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"backbone": name, "backbone_kwargs": kwargs}}, path)
    return teacher.eval()


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize("name,kwargs", CASES)
def test_export_round_trip_keeps_name_and_kwargs(tmp_path, name, kwargs, suffix):
    teacher = _fake_dino_checkpoint(tmp_path / "run.ckpt", name, kwargs)
    out = tmp_path / f"out{suffix}"
    result = export_main([str(tmp_path / "run.ckpt"), str(out)])
    assert result["model"] == name and result["format"] == suffix[1:]
    saved = read_checkpoint(out)
    assert saved["hyper_parameters"] == {"backbone": name, "backbone_kwargs": kwargs}
    create_model(name, **kwargs).load_state_dict(saved["state_dict"], strict=True)
    rebuilt = build_backbone(out).eval()
    assert rebuilt.name == name and type(rebuilt) is type(teacher)
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), teacher(x), rtol=0, atol=0)


def test_recorded_tokens_norm_is_applied():
    # Without the record, nano's default (tokens_norm=False) would be built: the outputs would differ.
    name, kwargs = CASES[0]
    plain = create_model(name, depth=1)
    assert plain.cls_attn_blocks[0].tokens_norm is False
    assert create_model(name, **kwargs).cls_attn_blocks[0].tokens_norm is True


# (our name and kwargs, timm's name): XCiT, and the timm-native CaiT, ViT, DINOv3 ViT and ConvNeXt, at a size
# their timm model takes.
TIMM = [
    ("xcit_nano_12_p16", {"depth": 1}, "xcit_nano_12_p16_224", (2, 3, 64, 96)),
    ("cait_xxs24", {"depth": 1}, "cait_xxs24_224", (2, 3, 224, 224)),
    ("vit_small_patch16_224", {"depth": 1}, "vit_small_patch16_224", (2, 3, 224, 224)),
    # DINOv3's ViT (timm pools by mean unless told global_pool="token", DINOv3's CLS) and ConvNeXt, tiny.
    (
        "vit_small_patch16_dinov3",
        dict(embed_dim=32, depth=2, num_heads=2, global_pool="token"),
        "vit_small_patch16_dinov3",
        (2, 3, 96, 96),
    ),
    ("convnext_tiny", {"depths": (1, 1, 1, 1), "dims": (8, 8, 16, 16)}, "convnext_tiny", (2, 3, 96, 64)),
]


@pytest.mark.parametrize("name,kwargs,timm_name,size", TIMM)
def test_timm_loads_the_safetensors_export_strictly(tmp_path, name, kwargs, timm_name, size):
    import timm
    from safetensors import safe_open
    from safetensors.torch import load_file

    teacher = _fake_dino_checkpoint(tmp_path / "run.ckpt", name, kwargs)
    export_main([str(tmp_path / "run.ckpt"), str(tmp_path / "teacher.safetensors")])
    with safe_open(str(tmp_path / "teacher.safetensors"), framework="pt") as handle:
        assert handle.metadata()["timm_model"] == timm_name
    theirs = timm.create_model(timm_name, pretrained=False, num_classes=0, **kwargs)
    theirs.load_state_dict(load_file(str(tmp_path / "teacher.safetensors")), strict=True)
    # timm's own reader picks safetensors by the extension.
    again = timm.create_model(timm_name, pretrained=False, num_classes=0, **kwargs)
    timm.models.load_checkpoint(again, str(tmp_path / "teacher.safetensors"), strict=True)
    x = torch.randn(*size)
    with torch.no_grad():
        ours = teacher(x)
        torch.testing.assert_close(theirs.eval()(x), ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again.eval()(x), ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,kwargs", CASES[3:])
def test_families_timm_lacks_record_no_timm_name(tmp_path, name, kwargs):
    from safetensors import safe_open

    _fake_dino_checkpoint(tmp_path / "run.ckpt", name, kwargs)
    export_main([str(tmp_path / "run.ckpt"), str(tmp_path / "teacher.safetensors")])
    with safe_open(str(tmp_path / "teacher.safetensors"), framework="pt") as handle:
        assert set(handle.metadata()) == {"format", "backbone", "backbone_kwargs"}
