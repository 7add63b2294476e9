"""Patch masking through the backbone interface (iBOT): where the mask token goes and what it hides."""

from __future__ import annotations

import pytest
import torch

from ssl_xcit.models import create_model
from ssl_xcit.models.base import MaskingNotSupported

MASKABLE = {
    "xcit_nano_12_p8": {"depth": 2},
    "xcit_nano_12_p16": {"depth": 2},
    "vit_tiny_patch16_224": {"depth": 2},
    "cait_xxs24": {"depth": 2},
}


def _model(name):
    model = create_model(name, **MASKABLE[name]).eval()
    model.enable_masking()
    with torch.no_grad():
        model.mask_token.normal_()  # a trained token, not the zeros it starts from
    return model


def _mask(model, batch, size):
    h, w = model.token_grid(size, size)
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(batch, h * w, generator=gen) < 0.4
    mask[-1] = False  # one image keeps every patch
    return mask


def _scramble_masked_pixels(model, x, mask):
    """``x`` with new random content inside every masked patch and the same pixels elsewhere."""
    p = model.size_multiple
    h, w = model.token_grid(*x.shape[-2:])
    pixel_mask = mask.reshape(-1, 1, h, w).repeat_interleave(p, 2).repeat_interleave(p, 3)
    return torch.where(pixel_mask, torch.randn_like(x) * 3, x)


@pytest.mark.parametrize("name", list(MASKABLE))
def test_masked_content_reaches_no_output(name):
    """iBOT's guarantee: a masked patch's pixels influence neither its own token nor any other output."""
    model = _model(name)
    x = torch.randn(3, 3, 64, 64)
    mask = _mask(model, 3, 64)
    with torch.no_grad():
        cls, patches = model.forward_cls_patches(x, mask)
        cls2, patches2 = model.forward_cls_patches(_scramble_masked_pixels(model, x, mask), mask)
    torch.testing.assert_close(cls, cls2, rtol=0, atol=1e-5)
    torch.testing.assert_close(patches, patches2, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(MASKABLE))
def test_unmasked_images_are_unchanged_and_masks_use_the_token(name):
    model = _model(name)
    x = torch.randn(3, 3, 64, 64)
    mask = _mask(model, 3, 64)
    with torch.no_grad():
        cls, patches = model.forward_cls_patches(x, mask)
        plain_cls, plain_patches = model.forward_cls_patches(x)
        # Without a mask, the pair is exactly forward() and the patch tokens of forward_features.
        torch.testing.assert_close(plain_cls, model(x))
        # The image with no masked patch is computed as if no mask had been given (eval mode).
        torch.testing.assert_close(cls[-1], plain_cls[-1], rtol=0, atol=1e-5)
        torch.testing.assert_close(patches[-1], plain_patches[-1], rtol=0, atol=1e-5)
        assert (patches[0] - plain_patches[0]).abs().max() > 1e-3
        # The mask token is what masked patches become: changing it changes the output.
        # (A random change: a constant shift along channels would vanish in the first LayerNorm.)
        model.mask_token.add_(torch.randn_like(model.mask_token))
        cls3, patches3 = model.forward_cls_patches(x, mask)
    assert (patches3[0] - patches[0]).abs().max() > 1e-3
    torch.testing.assert_close(cls3[-1], cls[-1], rtol=0, atol=1e-5)
    tokens, grid = model.forward_patch_tokens(x, mask)
    assert tokens.shape[1] == grid[0] * grid[1] == mask.shape[1]


def test_xcit_stem_overlaps_patches_so_pixels_are_blanked_too():
    """XCiT's convolutional stem (3x3 stride-2 convolutions) sees pixels of neighbouring patches: replacing the
    masked patch's embedding alone would leak its border into the neighbours. The model therefore blanks masked
    pixels before the stem (``test_masked_content_reaches_no_output`` passes because of it)."""
    model = _model("xcit_nano_12_p16")
    x = torch.randn(1, 3, 64, 64)
    y = x.clone()
    y[..., 16:32, 16:32] = torch.randn(1, 3, 16, 16) * 3  # patch (1, 1) of the 4x4 grid
    with torch.no_grad():
        ex, _ = model.patch_embed(x)
        ey, _ = model.patch_embed(y)
    changed = ((ex - ey).abs().amax(-1) > 1e-6).reshape(4, 4)
    assert changed[1, 1]
    assert changed.sum() > 1  # the neighbours see the patch's border


def test_lpi_spreads_only_the_mask_token_not_the_content():
    """XCiT's local patch interaction (a 3x3 depthwise convolution over the token grid) runs after masking:
    it carries the mask token and positional encoding to the neighbours, like attention does, but no pixel
    of the masked patch. Changing the mask token changes unmasked neighbours; changing masked pixels does
    not (previous tests)."""
    model = _model("xcit_nano_12_p16")
    x = torch.randn(1, 3, 128, 128)
    mask = torch.zeros(1, 64, dtype=torch.bool)
    mask[0, 9] = True  # token (1, 1) of the 8x8 grid
    block = model.blocks[0]
    with torch.no_grad():
        tokens, (h, w) = model._embed(x, mask)
        before = block.local_mp(block.norm3(tokens), h, w)
        model.mask_token.add_(torch.randn_like(model.mask_token))
        tokens2, _ = model._embed(x, mask)
        after = block.local_mp(block.norm3(tokens2), h, w)
    changed = ((before - after).abs().amax(-1) > 1e-6).reshape(8, 8)
    # Two 3x3 depthwise convolutions: the masked token (1, 1) reaches tokens up to 2 steps away, no further.
    assert changed[0:4, 0:4].all()
    assert not changed[4:, :].any() and not changed[:, 4:].any()


@pytest.mark.parametrize("name", ["crossformerpp_small", "bixt_ti_l64_p16"])
def test_families_without_masking_say_which_work(name):
    model = create_model(name)
    with pytest.raises(MaskingNotSupported, match=r"cannot take iBOT's patch masks.*xcit, vit, cait"):
        model.enable_masking()


def test_mask_of_the_wrong_shape_names_both():
    model = _model("xcit_nano_12_p16")
    with pytest.raises(ValueError, match=r"patch mask of shape \(2, 9\).*token grid"):
        model.forward_cls_patches(torch.randn(2, 3, 64, 64), torch.zeros(2, 9, dtype=torch.bool))
