"""DINOv3's ViTs (timm's Eva) and ConvNeXts behind the backbone interface: outputs equal timm's forward at the
native size and DINO's crop sizes, registers stay out of the patch grid, iBOT's mask token sits where DINOv3's
code puts it, and Meta's own checkpoint layouts convert as timm's converters do, by value."""

from __future__ import annotations

import re

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat
from timm.models import convnext as timm_convnext
from timm.models import eva as timm_eva

from ssl_xcit.dino.init_from import fitted_backbone_state
from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model
from ssl_xcit.models.base import MaskingNotSupported
from ssl_xcit.models.checkpoint import backbone_from_checkpoint

# Tiny DINOv3 ViTs: timm's own architecture with small widths (4 * heads divides the head dim for RoPE).
TINY = dict(embed_dim=32, depth=2, num_heads=2)
VITS = [
    ("vit_small_patch16_dinov3", TINY),
    ("vit_small_patch16_dinov3_qkvb", TINY),
    ("vit_small_plus_patch16_dinov3", TINY),  # SwiGLU
]
CONVNEXT = dict(depths=(1, 1, 2, 1), dims=(8, 16, 24, 32))
SIZES = [
    (256, 256),
    (224, 224),
    (96, 96),
    (32, 48),
]  # native, DINO's global and local crops, a small test size


def _pair(name: str, kwargs: dict):
    """Ours (random) and timm's model of the same name with the same weights, both in eval mode."""
    ours = create_model(name, **kwargs).eval()
    with torch.no_grad():  # LayerScale 1 and non-zero biases: every part of the block shows in the output
        for key, value in ours.state_dict().items():
            if key.endswith(("gamma_1", "gamma_2", "q_bias", "v_bias")):
                value.normal_()
    pool = {"global_pool": "token"} if ours.family == "dinov3" else {}
    theirs = timm.create_model(name, pretrained=False, num_classes=0, **pool, **kwargs).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


@pytest.mark.parametrize("name,kwargs", VITS)
def test_vit_equals_timm_at_every_size_and_keeps_registers_out_of_the_grid(name, kwargs):
    ours, theirs = _pair(name, kwargs)
    assert ours.num_prefix_tokens == 5 and ours.embed_dim == ours.dense_dim == 32
    for size in SIZES:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            tokens = theirs.forward_features(x)
            torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
            torch.testing.assert_close(ours(x), tokens[:, 0], rtol=0, atol=0)  # the final-norm CLS
            patches, grid = ours.forward_patch_tokens(x)
            cls, patches2 = ours.forward_cls_patches(x)
            blocks = ours.get_intermediate_layers(x, 2)
            reference = theirs.forward_intermediates(x, indices=2, output_fmt="NLC", intermediates_only=True)
        assert grid == (size[0] // 16, size[1] // 16) and patches.shape[1] == grid[0] * grid[1]
        torch.testing.assert_close(patches, tokens[:, 5:], rtol=0, atol=0)  # CLS and 4 registers dropped
        torch.testing.assert_close(patches2, patches, rtol=0, atol=0)
        for got, want in zip(blocks, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rope_follows_the_grid_of_each_input():
    """The same weights see a 2x3 and a 3x2 grid differently (RoPE per grid), as timm's model does."""
    ours, _ = _pair(*VITS[0])
    x = torch.randn(1, 3, 32, 48)
    with torch.no_grad():
        wide = ours.forward_patch_tokens(x)[0]
        tall = ours.forward_patch_tokens(x.transpose(-1, -2))[0]
    assert not torch.allclose(wide.sort(dim=1).values, tall.sort(dim=1).values, atol=1e-4)


def test_attention_maps_are_the_cls_query_over_the_rotated_patch_keys():
    ours, theirs = _pair(*VITS[1])
    x = torch.randn(2, 3, 48, 32)
    with torch.no_grad():
        maps, grid = ours.get_attention_maps(x)
        # By hand: the tokens entering the last block, its q/k with timm's RoPE on the patch part only.
        _, pre = theirs.forward_intermediates(x, indices=[0], output_fmt="NLC", return_prefix_tokens=True)[1][
            0
        ]
        inner = theirs.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)[0]
        tokens = torch.cat([pre, inner], dim=1)
        block = theirs.blocks[-1]
        u = block.norm1(tokens)
        bias = torch.cat([block.attn.q_bias, torch.zeros_like(block.attn.q_bias), block.attn.v_bias])
        q, k, _ = F.linear(u, block.attn.qkv.weight, bias).reshape(2, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        rope = theirs.rope.get_embed(shape=grid)
        q_cls = q[:, :, :1]  # the CLS query takes no rotation
        k_patch = apply_rot_embed_cat(k[:, :, 5:], rope, half=True)
        k_all = torch.cat([k[:, :, :5], k_patch], dim=2)
        weights = (q_cls @ k_all.transpose(-1, -2) * 16**-0.5).softmax(-1)[:, :, 0]
    assert grid == (3, 2) and maps[0].shape == (2, 2, 6)
    torch.testing.assert_close(maps[0], weights[:, :, 5:], rtol=1e-5, atol=1e-6)


def test_mask_token_replaces_the_patch_embedding_before_rope_and_the_prefix():
    """DINOv3's prepare_tokens_with_masks: the masked patch's embedding becomes the mask token, then CLS and
    registers are prepended and RoPE rotates it as its patch. Reference: timm's forward with the patch
    embedding's output edited by a hook."""
    ours, theirs = _pair(*VITS[0])
    ours.enable_masking()
    with torch.no_grad():
        ours.mask_token.normal_()
    x = torch.randn(2, 3, 32, 48)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, [1, 4]] = True
    mask[1, 0] = True

    def edit(_module, _inputs, out):
        return torch.where(mask.reshape(2, 2, 3, 1), ours.mask_token.reshape(-1), out)

    handle = theirs.patch_embed.register_forward_hook(edit)
    with torch.no_grad():
        want = theirs.forward_features(x)
    handle.remove()
    with torch.no_grad():
        cls, patches = ours.forward_cls_patches(x, mask)
        plain = ours.forward_cls_patches(x, torch.zeros_like(mask))[1]
    torch.testing.assert_close(patches, want[:, 5:], rtol=0, atol=0)
    torch.testing.assert_close(cls, want[:, 0], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(plain, ours.forward_patch_tokens(x)[0], rtol=0, atol=0)
    # Two masked patches hold the same token at different positions: only RoPE tells them apart (without
    # positions, attention would give identical tokens identical outputs).
    assert (patches[0, 1] - patches[0, 4]).abs().max() > 1e-6


def test_convnext_equals_timm_and_gives_dinov3s_cls_and_patch_tokens():
    ours, theirs = _pair("convnext_tiny", CONVNEXT)
    assert ours.size_multiple == 32 and ours.depth == 5 and ours.embed_dim == ours.dense_dim == 32
    for size in [(224, 224), (96, 96), (64, 96)]:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            feature_map = theirs.forward_features(x)
            torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
            patches, grid = ours.forward_patch_tokens(x)
            cls, patches2 = ours.forward_cls_patches(x)
            last = ours.get_intermediate_cls(x, 1)[0]
        # DINOv3's ConvNeXt: one LayerNorm over [mean of the last map; its positions], by hand.
        tokens = torch.cat([feature_map.mean((2, 3))[:, None], feature_map.flatten(2).transpose(1, 2)], 1)
        normed = F.layer_norm(tokens, (32,), theirs.head.norm.weight, theirs.head.norm.bias, eps=1e-6)
        assert grid == (size[0] // 32, size[1] // 32)
        torch.testing.assert_close(cls, normed[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(patches, normed[:, 1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(patches2, patches, rtol=0, atol=0)
        torch.testing.assert_close(last, cls, rtol=0, atol=0)
    widths = [t.shape[-1] for t in ours.get_intermediate_layers(torch.randn(1, 3, 64, 64), [0, 1, 2, 4])]
    assert widths == [8, 16, 24, 32]


def test_convnext_refuses_ibot_in_one_line():
    model = create_model("convnext_tiny", **CONVNEXT)
    with pytest.raises(MaskingNotSupported, match="convolution mixes each patch") as info:
        model.enable_masking()
    assert "\n" not in str(info.value)


def test_create_model_no_longer_refuses_an_eva():
    assert type(create_model("vit_base_patch16_dinov3", device="meta")).__name__ == "DinoV3ViT"
    with pytest.raises(UserError, match="input size 40x40 does not fit"):
        create_model(*VITS[0][:1], **TINY)(torch.randn(1, 3, 40, 40))


# ------------------------------------------------------------------------------------ Meta's layouts
def _meta_vit(state: dict, periods: torch.Tensor, mask_token: torch.Tensor) -> dict:
    """timm's DINOv3 names -> Meta's hub layout (from dinov3's vision_transformer.py and its layers): the
    fused qkv bias keeps a random key part that its ``bias_mask`` zeroes; a model without q/v biases gets a
    zero fused bias, as the distilled hub models have."""
    swiglu = any(".mlp.fc1_g." in k for k in state)
    renames = [("reg_token", "storage_tokens"), (".gamma_1", ".ls1.gamma"), (".gamma_2", ".ls2.gamma")]
    if swiglu:
        renames += [(".mlp.fc1_g.", ".mlp.w1."), (".mlp.fc1_x.", ".mlp.w2."), (".mlp.fc2.", ".mlp.w3.")]
    out = {"mask_token": mask_token, "rope_embed.periods": periods}
    for key, value in state.items():
        if key.endswith(("attn.q_bias", "attn.v_bias")):
            continue
        if key.endswith("attn.qkv.weight"):
            base = key[: -len("weight")]
            width = value.shape[0] // 3
            q, v = (state.get(base[: -len("qkv.")] + p, torch.zeros(width)) for p in ("q_bias", "v_bias"))
            out[base + "bias"] = torch.cat([q, torch.randn(width), v])
            out[base + "bias_mask"] = torch.cat([torch.ones(width), torch.zeros(width), torch.ones(width)])
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return out


@pytest.mark.parametrize("name,kwargs", VITS)
def test_meta_dinov3_layout_converts_by_value_as_timms_converter_does(name, kwargs):
    ours, _ = _pair(name, kwargs)
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    periods = ours.rope.periods.to(torch.bfloat16)  # Meta stores them rounded
    meta = _meta_vit(state, periods, torch.randn(1, 32))
    assert "storage_tokens" in meta and "blocks.0.ls1.gamma" in meta
    fresh = create_model(name, **kwargs)
    fresh.load_state_dict(fitted_backbone_state(meta, fresh, "backbone", name, "SRC"), strict=True)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    # timm's own converter (its checkpoint_filter_fn for these models) gives the same tensors.
    reference = timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
    converted = timm_eva.checkpoint_filter_fn(dict(meta), reference)
    assert set(converted) == set(state)
    for key, value in converted.items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)


def _meta_small(**changes) -> tuple[dict, torch.nn.Module]:
    ours, _ = _pair("vit_small_patch16_dinov3_qkvb", TINY)
    meta = _meta_vit(dict(ours.state_dict()), ours.rope.periods.to(torch.bfloat16), torch.randn(1, 32))
    meta.update(changes)
    return meta, create_model("vit_small_patch16_dinov3_qkvb", **TINY)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_embed.periods": torch.ones(2)}, "rope_embed.periods .* does not equal the RoPE periods"),
        ({"blocks.1.attn.qkv.bias_mask": torch.ones(96)}, "blocks.1.attn.qkv.bias: its key part is not zero"),
        (
            {"blocks.0.ls1.gamma": torch.ones(31)},
            r"shapes \(source vs model\) \[blocks.0.gamma_1 \(31,\) vs \(32,\)",
        ),
        ({"blocks.1.norm1.weight": None}, r"missing \[blocks.1.norm1.weight\]"),
        ({"blocks.0.attn.extra": torch.ones(1)}, r"unexpected \[blocks.0.attn.extra\]"),
    ],
)
def test_a_misfit_meta_file_is_refused_in_one_line_naming_the_key(change, message, monkeypatch):
    """The check ``--model.init_from`` and ``--model.teacher`` make (ssl_xcit.dino.init_from)."""
    from ssl_xcit.dino import init_from

    # The hint after a misfit searches every family's variants (seconds on a cold process); not tested here.
    monkeypatch.setattr(init_from, "infer_architecture", lambda state: None)
    meta, model = _meta_small(**{k: v for k, v in change.items() if v is not None})
    for key in [k for k, v in change.items() if v is None]:
        del meta[key]
    with pytest.raises(UserError, match=message) as info:
        init_from.fitted_backbone_state(
            meta, model, "student backbone", "vit_small_patch16_dinov3_qkvb", "SRC"
        )
    assert "\n" not in str(info.value)


def test_non_zero_query_biases_need_the_qkvb_variant():
    meta, _ = _meta_small()
    with pytest.raises(UserError, match="non-zero query/value biases.*use its _qkvb variant") as info:
        fitted_backbone_state(meta, create_model("vit_small_patch16_dinov3", **TINY), "backbone", "S", "SRC")
    assert "\n" not in str(info.value)


def test_a_meta_file_names_its_variant_and_truncated_depth():
    """A Meta hub file carries no name: the width, q/v biases and depth say which DINOv3 ViT it is."""
    model = create_model("vit_small_patch16_dinov3_qkvb", depth=1)
    meta = _meta_vit(dict(model.state_dict()), model.rope.periods.to(torch.bfloat16), torch.zeros(1, 384))
    rebuilt = backbone_from_checkpoint({"teacher": meta}, "meta.pth")
    assert rebuilt.name == "vit_small_patch16_dinov3_qkvb" and rebuilt.depth == 1
    torch.testing.assert_close(
        rebuilt.state_dict()["blocks.0.attn.v_bias"], model.state_dict()["blocks.0.attn.v_bias"]
    )


def test_meta_convnext_layout_converts_as_timms_converter_does():
    ours, _ = _pair("convnext_tiny", CONVNEXT)
    state = dict(ours.state_dict())
    meta = {}
    for key, value in state.items():  # timm's names -> DINOv3's convnext.py names
        k = key.replace("stem.", "downsample_layers.0.")
        k = re.sub(r"^stages\.(\d+)\.downsample\.", r"downsample_layers.\1.", k)
        k = re.sub(r"^stages\.(\d+)\.blocks\.(\d+)\.", r"stages.\1.\2.", k)
        k = k.replace("conv_dw", "dwconv").replace("mlp.fc1", "pwconv1").replace("mlp.fc2", "pwconv2")
        k = k.replace("head.norm.", "norm.")
        meta[k] = value
    meta["norms.3.weight"], meta["norms.3.bias"] = meta["norm.weight"], meta["norm.bias"]
    fresh = create_model("convnext_tiny", **CONVNEXT)
    fresh.load_state_dict(fitted_backbone_state(meta, fresh, "backbone", "convnext_tiny", "SRC"), strict=True)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    converted = timm_convnext.checkpoint_filter_fn(dict(meta), fresh)
    assert set(converted) == set(state)
    meta["norms.3.bias"] = torch.ones(32)
    with pytest.raises(UserError, match="norms.3.bias is not a copy of norm.bias"):
        fitted_backbone_state(meta, fresh, "backbone", "convnext_tiny", "SRC")


def test_meta_dinov2_register_layout_converts_as_timms_converter_does():
    """DINOv2 with registers (vit family): Meta's ``register_tokens`` and a position row for CLS."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    kwargs = dict(depth=1, img_size=28, embed_dim=32, num_heads=2)
    ours = create_model("vit_small_patch14_reg4_dinov2", **kwargs).eval()
    meta = {
        k: torch.randn_like(v) for k, v in ours.state_dict().items() if k not in ("reg_token", "pos_embed")
    }
    meta |= {
        "register_tokens": torch.randn(1, 4, 32),
        "pos_embed": torch.randn(1, 5, 32),
        "mask_token": torch.randn(1, 32),
    }
    want = checkpoint_filter_fn(dict(meta), timm.create_model("vit_small_patch14_reg4_dinov2", **kwargs))
    ours.load_state_dict(fitted_backbone_state(meta, ours, "backbone", "vit", "SRC"), strict=True)
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def test_a_dynamic_resolution_program_is_refused_in_one_line_for_the_vit():
    from ssl_xcit.models.export import check_resolution

    model = create_model("vit_small_patch16_dinov3", **TINY)
    with pytest.raises(UserError, match="RoPE's sine and cosine tables .* pass --fixed-resolution") as info:
        check_resolution(model, 64, fixed_resolution=False)
    assert "\n" not in str(info.value) and check_resolution(model, 64, fixed_resolution=True) is False
    assert check_resolution(create_model("convnext_tiny", **CONVNEXT), 64, fixed_resolution=False) is True
