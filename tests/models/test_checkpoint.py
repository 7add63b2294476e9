"""Every checkpoint layout loads through one loader; bad checkpoints get errors naming keys, shapes and paths."""

from __future__ import annotations

import pytest
import timm
import torch

from ssl_xcit.models import build_backbone, create_model, infer_model_name, list_models, load_pretrained


def _official_layout(state: dict) -> dict:
    """Turn our (= timm) naming into the official XCiT/DINO naming: pos_embeder and a fused CA qkv."""
    out = {}
    for key, value in state.items():
        if key.startswith("pos_embed."):
            out["pos_embeder." + key[len("pos_embed.") :]] = value
        elif ".attn.q." in key and key.startswith("cls_attn_blocks"):
            stem, kind = key.split(".attn.q.")
            parts = [state[f"{stem}.attn.{p}.{kind}"] for p in "qkv"]
            out[f"{stem}.attn.qkv.{kind}"] = torch.cat(parts, dim=0)
        elif (".attn.k." in key or ".attn.v." in key) and key.startswith("cls_attn_blocks"):
            continue
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(0)
    model = create_model("xcit_nano_12_p16").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _same(a, b):
    x = torch.randn(2, 3, 48, 48)
    a.eval(), b.eval()
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


DINO_HEAD = {
    "head.mlp.0.weight": torch.zeros(2048, 128),
    "head.last_layer.weight_g": torch.ones(4096, 1),
    "head.last_layer.weight_v": torch.zeros(4096, 256),
}


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: sd,
        lambda sd: {"model": sd},
        lambda sd: {"state_dict": sd},
        lambda sd: {
            "teacher": {f"module.backbone.{k}": v for k, v in sd.items()}
            | {f"module.{k}": v for k, v in DINO_HEAD.items()}
        },
        lambda sd: {"student": {f"backbone.{k}": v for k, v in sd.items()}},
        lambda sd: {f"module.{k}": v for k, v in sd.items()},
    ],
    ids=["plain", "model", "state_dict", "dino-full-teacher", "student", "ddp"],
)
@pytest.mark.parametrize("official", [False, True], ids=["timm-names", "official-names"])
def test_every_layout_loads_strictly(source, wrap, official):
    state = source.state_dict()
    ckpt = wrap(_official_layout(state) if official else state)
    target = create_model("xcit_nano_12_p16")
    report = load_pretrained(target, ckpt, strict=True)
    assert report.missing == [] and report.unexpected == []
    assert _same(source, target) == 0.0


def test_lightning_checkpoint_prefers_teacher_and_knows_its_architecture(source, tmp_path):
    student = create_model("xcit_nano_12_p16")
    state = {f"teacher.backbone.{k}": v for k, v in source.state_dict().items()}
    state |= {f"student.backbone.{k}": v for k, v in student.state_dict().items()}
    state |= {f"teacher.head.{k[5:]}": v for k, v in DINO_HEAD.items()}
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": {"backbone": "xcit_nano_12_p16"}, "epoch": 3}, path)
    model = build_backbone(path)
    assert model.name == "xcit_nano_12_p16"
    assert _same(source, model) == 0.0


def test_timm_weights_load_and_official_weights_load_into_timm(source):
    reference = timm.create_model("xcit_nano_12_p16_224", num_classes=0)
    ours = create_model("xcit_nano_12_p16")
    ours.load_state_dict(reference.state_dict(), strict=True)
    from timm.models.xcit import checkpoint_filter_fn

    reference.load_state_dict(
        checkpoint_filter_fn(_official_layout(source.state_dict()), reference), strict=True
    )
    assert _same(source, reference) < 1e-5


def _shapes(name: str) -> dict:
    return {k: tuple(v.shape) for k, v in create_model(name, device="meta").state_dict().items()}


# Beyond S/16 and ConvNeXt-T, the DINOv3 ViTs and ConvNeXts take one to several seconds each on the meta device.
_SLOW_SHAPES = set(list_models("dinov3") + list_models("convnext")) - {
    "vit_small_patch16_dinov3",
    "convnext_tiny",
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_SHAPES else n for n in list_models()]
)
def test_architecture_is_inferred_from_shapes(name):
    inferred = infer_model_name(create_model(name, device="meta").state_dict())
    if inferred != name:
        # BiXT's token strides 16/8/4 share every parameter shape: a bare state dict cannot tell them apart
        # (exports and our checkpoints record the name, so only foreign state dicts are ambiguous).
        assert name.startswith("bixt_") and _shapes(inferred) == _shapes(name), (name, inferred)


def test_wrong_shapes_name_keys_and_both_shapes(source):
    target = create_model("xcit_tiny_12_p16")
    with pytest.raises(
        ValueError, match=r"cls_token: checkpoint \(1, 1, 128\) vs model \(1, 1, 192\)"
    ) as info:
        load_pretrained(target, source.state_dict())
    assert "xcit_nano_12_p16" in str(info.value)  # says what the checkpoint looks like


def test_missing_and_unexpected_keys_are_named(source):
    state = dict(source.state_dict())
    del state["norm.weight"]
    state["extra.thing"] = torch.zeros(1)
    with pytest.raises(
        ValueError, match=r"missing keys \['norm.weight'\]; unexpected keys \['extra.thing'\]"
    ):
        load_pretrained(create_model("xcit_nano_12_p16"), state)
    with pytest.warns(UserWarning, match="1 missing keys"):
        report = load_pretrained(create_model("xcit_nano_12_p16"), state, strict=False)
    assert report.missing == ["norm.weight"] and report.unexpected == ["extra.thing"]


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "weights.pth"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        build_backbone(missing)
    with pytest.raises(FileNotFoundError, match="weights.pth"):
        load_pretrained(create_model("xcit_nano_12_p16", device="meta"), missing)


def test_corrupt_file_is_reported(tmp_path):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read checkpoint .*bad.pth"):
        build_backbone(bad)


def test_checkpoint_of_another_architecture(source, tmp_path):
    path = tmp_path / "nano.pth"
    torch.save(source.state_dict(), path)
    with pytest.raises(
        ValueError, match="holds a xcit_nano_12_p16 backbone, but xcit_small_12_p16 was requested"
    ):
        build_backbone(path, name="xcit_small_12_p16")


def test_non_xcit_checkpoint_needs_a_name(tmp_path):
    path = tmp_path / "resnet.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, path)
    with pytest.raises(ValueError, match="cannot tell the architecture"):
        build_backbone(path)


def test_truncated_depth_is_inferred_and_recorded_kwargs_are_applied(tmp_path):
    shallow = create_model("xcit_nano_12_p16", depth=4).eval()
    plain = tmp_path / "plain.pth"
    torch.save(shallow.state_dict(), plain)
    assert _same(shallow, build_backbone(plain)) == 0.0  # depth 4 inferred from the block keys
    ckpt = tmp_path / "run.ckpt"
    state = {f"teacher.backbone.{k}": v for k, v in shallow.state_dict().items()}
    torch.save(
        {
            "state_dict": state,
            "hyper_parameters": {"backbone": "xcit_nano_12_p16", "backbone_kwargs": {"depth": 4}},
        },
        ckpt,
    )
    assert build_backbone(ckpt).depth == 4
    with pytest.raises(
        ValueError, match="holds a xcit_nano_12_p16 with depth=4 backbone, but xcit_nano_12_p16 was"
    ):
        build_backbone(ckpt, name="xcit_nano_12_p16")
    assert build_backbone(ckpt, name="xcit_nano_12_p16", depth=4).depth == 4
