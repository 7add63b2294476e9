"""``get_dense_layers``: each family's final-norm patch tokens of chosen blocks, against a direct computation
(a model cut after that block running its own final stage, timm's normed intermediates, the family's own
final-token accessors)."""

from __future__ import annotations

import pytest
import torch

from ssl_xcit.models import create_model


def _cut(name: str, kwargs: dict, full: torch.nn.Module, unused: str = "") -> torch.nn.Module:
    """The same weights in a model built with fewer blocks (the later blocks' weights left out); only names
    containing ``unused`` (weights the compared tokens never pass through) may be missing."""
    model = create_model(name, **kwargs).eval()
    missing, _ = model.load_state_dict(full.state_dict(), strict=False)
    assert all(unused and unused in key for key in missing), missing
    return model


@torch.no_grad()
def test_xcit_tokens_are_those_of_a_model_ending_at_each_block():
    torch.manual_seed(0)
    full = create_model("xcit_nano_12_p16", depth=5).eval()
    x = torch.randn(2, 3, 32, 48)
    layers = full.get_dense_layers(x, 4)
    assert len(layers) == 4
    for depth, tokens in zip(range(2, 6), layers, strict=True):
        # Class attention and the final norm, run on this block's output by a model that ends there.
        expected = _cut("xcit_nano_12_p16", {"depth": depth}, full).forward_features(x)[:, 1:]
        torch.testing.assert_close(tokens, expected)
    # The last block's are the network's own final-norm patch tokens, not the tokens before class attention.
    torch.testing.assert_close(full.get_dense_layers(x)[0], full.forward_cls_patches(x)[1])
    assert not torch.allclose(layers[-1], full.forward_patch_tokens(x)[0], atol=1e-3)


@torch.no_grad()
def test_vit_tokens_are_timms_normed_intermediates():
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", depth=5).eval()
    x = torch.randn(2, 3, 32, 48)
    ours = model.get_dense_layers(x, 4)
    theirs = model.forward_intermediates(x, indices=4, norm=True, output_fmt="NLC", intermediates_only=True)
    assert len(ours) == 4
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    raw = model.get_intermediate_layers(x, 4)
    assert not torch.allclose(ours[0], raw[0], atol=1e-3)  # --layers 4 used to skip the norm


@torch.no_grad()
def test_cait_tokens_are_those_of_a_model_ending_at_each_block():
    torch.manual_seed(0)
    full = create_model("cait_xxs24", depth=4).eval()
    x = torch.randn(1, 3, 32, 48)
    for depth, tokens in zip(range(1, 5), full.get_dense_layers(x, 4), strict=True):
        expected = _cut("cait_xxs24", {"depth": depth}, full).forward_features(x)[:, 1:]
        torch.testing.assert_close(tokens, expected)


@torch.no_grad()
def test_crossformerpp_tokens_are_normed_by_the_ln_after_their_stage():
    torch.manual_seed(0)
    model = create_model("crossformerpp_small", depths=(1, 1, 2, 2)).eval()
    x = torch.randn(1, 3, 64, 96)
    layers = model.get_dense_layers(x, 4)
    assert [t.shape[1] for t in layers] == [24, 24, 6, 6]  # two stage-3 blocks (stride 16), two stage-4 (32)
    torch.testing.assert_close(layers[-1], model.forward_features(x))
    torch.testing.assert_close(layers[1], model.forward_patch_tokens(x)[0])  # stage 3's last, its next LN


@torch.no_grad()
def test_bixt_tokens_are_normed_by_the_next_layers_token_ln():
    torch.manual_seed(0)
    full = create_model("bixt_ti_l64_p16", depth=4).eval()
    x = torch.randn(1, 3, 32, 48)
    layers = full.get_dense_layers(x, 3)  # bi-directional layers 0, 1, 2
    torch.testing.assert_close(layers[-1], full.forward_patch_tokens(x)[0])
    for depth, tokens in zip(range(2, 4), layers[:2], strict=True):
        # A model one layer past the block: its last layer's LN reads them, as the full model's next layer does
        # (that one-sided layer's latent-side projection, absent from a bi-directional layer, is not on the way).
        cut = _cut("bixt_ti_l64_p16", {"depth": depth}, full, unused="r_latents")
        torch.testing.assert_close(tokens, cut.forward_patch_tokens(x)[0])
    with pytest.raises(Exception, match="bi-directional layers 0 .. 2"):
        full.get_dense_layers(x, [3])


@torch.no_grad()
def test_dinov3_vit_tokens_are_timms_normed_intermediates_without_registers():
    torch.manual_seed(0)
    model = create_model("vit_small_patch16_dinov3", depth=3).eval()
    x = torch.randn(2, 3, 32, 48)
    ours = model.get_dense_layers(x, 3)
    theirs = model.forward_intermediates(x, indices=3, norm=True, output_fmt="NLC", intermediates_only=True)
    assert len(ours) == 3 and ours[0].shape == (2, 6, 384)  # CLS and the 4 registers left out
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours[-1], model.forward_patch_tokens(x)[0])


@torch.no_grad()
def test_convnext_tokens_are_layer_normed_over_channels_after_their_stage():
    torch.manual_seed(0)
    model = create_model("convnext_tiny", depths=(1, 1, 2, 1)).eval()
    x = torch.randn(1, 3, 64, 96)
    layers = model.get_dense_layers(x, 3)  # stage 3's two blocks (stride 16), stage 4's one (stride 32)
    assert [tuple(t.shape) for t in layers] == [(1, 24, 384), (1, 24, 384), (1, 6, 768)]
    torch.testing.assert_close(layers[-1], model.forward_patch_tokens(x)[0])
    raw = model.get_intermediate_layers(x, 3)
    norm = model.stages[3].downsample[0]  # the LayerNorm2d opening stage 4
    for tokens, before in zip(layers[:2], raw[:2], strict=True):
        expected = torch.nn.functional.layer_norm(before, (384,), norm.weight, norm.bias, norm.eps)
        torch.testing.assert_close(tokens, expected)
