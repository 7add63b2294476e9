from __future__ import annotations

import pytest
import torch

from ssl_xcit.models import create_model


@pytest.fixture(scope="module")
def nano():
    return create_model("xcit_nano_12_p16").eval()


@pytest.mark.parametrize("size", [(96, 96), (224, 224), (384, 384), (64, 208), (768, 768), (1024, 1024)])
def test_any_multiple_of_the_patch_works(nano, size):
    with torch.no_grad():
        tokens, grid = nano.forward_patch_tokens(torch.randn(1, 3, *size))
    assert grid == (size[0] // 16, size[1] // 16)
    assert tokens.shape == (1, grid[0] * grid[1], 128)


@pytest.mark.parametrize("size", [(100, 96), (225, 224), (8, 8)])
def test_other_sizes_name_the_size_and_the_patch(nano, size):
    with pytest.raises(
        ValueError, match=rf"input size {size[0]}x{size[1]} is not a multiple of the patch size 16"
    ):
        nano(torch.randn(1, 3, *size))


def test_patch8_model_accepts_multiples_of_8_only():
    model = create_model("xcit_nano_12_p8").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 40, 56)).shape == (2, 128)
    with pytest.raises(ValueError, match="patch size 8"):
        model(torch.randn(1, 3, 44, 56))


def test_wrong_rank_is_reported(nano):
    with pytest.raises(ValueError, match=r"\(B, C, H, W\).*\(3, 64, 64\)"):
        nano(torch.randn(3, 64, 64))


def test_cls_embedding_and_all_tokens(nano):
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        feats = nano.forward_features(x)
        cls = nano(x)
    assert feats.shape == (2, 1 + 4 * 6, 128)
    assert torch.equal(cls, feats[:, 0])
    # The final LayerNorm: every token has ~zero mean before its affine part (weights are 1/0 at init).
    assert feats.mean(-1).abs().max() < 1e-5


def test_intermediate_layers(nano):
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        last_two = nano.get_intermediate_layers(x, 2)
        chosen = nano.get_intermediate_layers(x, [0, 5, -1])
        final, grid = nano.forward_patch_tokens(x)
    assert len(last_two) == 2 and all(t.shape == (2, 16, 128) for t in last_two)
    assert torch.allclose(last_two[-1], final) and torch.allclose(chosen[-1], final)
    assert not torch.allclose(chosen[0], chosen[1])
    with pytest.raises(ValueError, match="out of range.*12 blocks"):
        nano.get_intermediate_layers(x, [12])


def test_intermediate_cls_last_equals_forward(nano):
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        cls = nano.get_intermediate_cls(x, 3)
        assert len(cls) == 3 and cls[0].shape == (2, 128)
        assert torch.allclose(cls[-1], nano(x), atol=1e-6)


def test_class_attention_maps(nano):
    x = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        maps, grid = nano.get_class_attention(x)
    assert grid == (4, 5) and len(maps) == 2
    for attn in maps:
        assert attn.shape == (2, 4, 1 + 20)  # (B, heads, CLS + patches)
        assert torch.allclose(attn.sum(-1), torch.ones(2, 4), atol=1e-5)
        assert (attn >= 0).all()


def test_class_attention_map_matches_an_explicit_computation(nano):
    x = torch.randn(1, 3, 32, 48)
    with torch.no_grad():
        maps, _ = nano.get_class_attention(x)
        tokens, _ = nano.forward_patch_tokens(x)
        seq = torch.cat((nano.cls_token, tokens), dim=1)
        block = nano.cls_attn_blocks[0]
        normed = block.norm1(seq)
        q = block.attn.q(normed[:, :1]).reshape(1, 4, 32)
        k = block.attn.k(normed).reshape(1, -1, 4, 32)
        expected = torch.softmax(torch.einsum("bhd,bnhd->bhn", q, k) / 32**0.5, dim=-1)
    assert torch.allclose(maps[0], expected, atol=1e-6)


def test_classifier_head():
    model = create_model("xcit_nano_12_p16", num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (2, 10)
        assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 128)


def test_grad_checkpointing_gives_the_same_gradients():
    model = create_model("xcit_nano_12_p16").train()
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(0)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for a, p in zip(plain, model.parameters(), strict=True):
        assert torch.allclose(a, p.grad, atol=1e-5)
