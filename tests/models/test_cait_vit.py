"""CaiT and timm-ViT backbones: timm parity, parameter counts, dynamic sizes, interface accessors, bad input."""

from __future__ import annotations

import pytest
import timm
import torch

from ssl_xcit.models import build_backbone, create_model, list_models, load_pretrained

# backbones.md §0: parameters of the official code without / with the 1000-class head.
CAIT_PARAMS = {
    "cait_xxs24": (11_763_264, 11_956_264),
    "cait_xxs36": (17_106_720, 17_299_720),
    "cait_xs24": (26_271_648, 26_560_648),
    "cait_xs36": (38_268_432, 38_557_432),
    "cait_s24": (46_531_200, 46_916_200),
    "cait_s36": (67_835_712, 68_220_712),
    "cait_s48": (89_140_224, 89_525_224),
    "cait_m24": (185_081_088, 185_850_088),
    "cait_m36": (270_160_512, 270_929_512),
    "cait_m48": (355_239_936, 356_008_936),
}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_every_cait_variant_is_registered():
    assert list_models("cait") == list(CAIT_PARAMS)


@pytest.mark.parametrize("name", list(CAIT_PARAMS))
def test_cait_parameter_counts_equal_backbones_md(name):
    headless, with_head = CAIT_PARAMS[name]
    assert _count(create_model(name, device="meta")) == headless
    assert _count(create_model(name, num_classes=1000, device="meta")) == with_head


@pytest.mark.parametrize("timm_name", timm.list_models("cait_*"))
def test_cait_state_dict_layout_equals_timm(timm_name):
    with torch.device("meta"):
        theirs = timm.create_model(timm_name, num_classes=1000)
    ours = create_model(timm_name, num_classes=1000, device="meta")  # _384/_448 set img_size
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }


def _tiny_pair(timm_name: str, **kwargs):
    torch.manual_seed(0)
    theirs = timm.create_model(timm_name, num_classes=0, **kwargs).eval()
    ours = create_model(timm_name, **kwargs).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def test_cait_equals_timm_at_native_size():
    ours, theirs = _tiny_pair("cait_xxs24_224", depth=2)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), rtol=0, atol=1e-5)


def test_cait_other_sizes_interpolate_the_positional_grid_bicubically():
    model = create_model("cait_xxs24", depth=2).eval()
    with torch.no_grad():
        for side, grid in ((96, 6), (160, 10)):
            x = torch.randn(2, 3, side, side + 32)
            tokens, hw = model.forward_patch_tokens(x)
            assert hw == (grid, grid + 2) and tokens.shape == (2, grid * (grid + 2), 192)
            assert model(x).shape == (2, 192)
            # A model built natively at that size with the bicubically resampled grid gives the same output.
            native = create_model("cait_xxs24", depth=2, img_size=(side, side + 32)).eval()
            state = model.state_dict()
            state["pos_embed"] = model._pos_embed_for((grid, grid + 2))
            native.load_state_dict(state, strict=True)
            torch.testing.assert_close(native(x), model(x), rtol=0, atol=1e-5)


def test_cait_accessors_are_consistent():
    model = create_model("cait_xxs24", depth=3).eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        feats = model.forward_features(x)
        tokens, grid = model.forward_patch_tokens(x)
        torch.testing.assert_close(tokens, feats[:, 1:])
        cls = model.get_intermediate_cls(x, [1, 2])
        torch.testing.assert_close(cls[-1], model(x))
        layers = model.get_intermediate_layers(x, 2)
        assert [t.shape for t in layers] == [(2, 36, 192)] * 2
        maps, grid = model.get_attention_maps(x)
    assert len(maps) == 2 and maps[0].shape == (2, 4, 36) and grid == (6, 6)
    assert (maps[0].sum(-1) < 1).all() and (maps[0] > 0).all()  # softmax over [CLS, patches], CLS dropped


def test_cait_attention_maps_match_a_manual_softmax():
    model = create_model("cait_xxs24", depth=1).eval()
    model.blocks_token_only[0].attn.fused_attn = False
    seen = {}
    # Capture the real attention weights inside timm's ClassAttn by hooking the softmax input's consumer.
    attn = model.blocks_token_only[0].attn
    attn.attn_drop.register_forward_hook(lambda m, args, out: seen.setdefault("w", out))
    x = torch.randn(1, 3, 48, 64)
    with torch.no_grad():
        model(x)
        maps, _ = model.get_attention_maps(x)
    torch.testing.assert_close(maps[0], seen["w"][:, :, 0, 1:])


@pytest.mark.parametrize("timm_name", ["vit_small_patch16_224", "vit_small_patch8_224"])
def test_vit_equals_timm_at_native_size(timm_name):
    ours, theirs = _tiny_pair(timm_name, depth=2)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)


def test_vit_accessors_and_dynamic_size():
    model = create_model("vit_small_patch16_224", depth=2).eval()
    x = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        tokens, grid = model.forward_patch_tokens(x)
        assert grid == (6, 8) and tokens.shape == (2, 48, 384)
        torch.testing.assert_close(model.get_intermediate_cls(x, 1)[0], model(x))
        maps, _ = model.get_attention_maps(x)
        # The last block's attention with timm's own (non-fused) path, captured at its dropout.
        last = model.blocks[-1].attn
        last.fused_attn = False
        seen = {}
        last.attn_drop.register_forward_hook(lambda m, args, out: seen.setdefault("w", out))
        model(x)
    torch.testing.assert_close(maps[0], seen["w"][:, :, 0, 1:])
    assert model.size_multiple == 16 and model.dense_dim == 384 and model.family == "vit"


def test_any_timm_vit_name_and_non_plain_vit_is_refused():
    assert create_model("vit_tiny_patch16_384", device="meta").name == "vit_tiny_patch16_384"
    with pytest.raises(ValueError, match="vit_relpos_small_patch16_224.*not a plain timm VisionTransformer"):
        create_model("vit_relpos_small_patch16_224", device="meta")


@pytest.mark.parametrize("name", ["cait_xxs24", "vit_small_patch16_224"])
def test_size_that_does_not_fit_names_size_and_constraint(name):
    model = create_model(name, depth=1)
    with pytest.raises(ValueError, match="input size 100x96 .*multiples of 16"):
        model(torch.randn(1, 3, 100, 96))


def test_checkpoint_of_another_family_names_both(tmp_path):
    path = tmp_path / "cait.pth"
    torch.save(create_model("cait_xxs24", depth=2).state_dict(), path)
    with pytest.raises(ValueError, match="cait_xxs24 with depth=2 backbone.*a cait checkpoint, not xcit"):
        build_backbone(path, "xcit_nano_12_p16")
    with pytest.raises(ValueError, match="holds a cait backbone, but the model xcit_nano_12_p16 is a xcit"):
        load_pretrained(create_model("xcit_nano_12_p16"), path)
    model = build_backbone(path)  # inferred: family, variant and the truncated depth
    assert model.name == "cait_xxs24" and model.depth == 2
