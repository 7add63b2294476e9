"""BiXT: parameter counts, official parameter names, equivalence with the official code, any size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ssl_xcit.models.base import Backbone
from ssl_xcit.models.bixt import VARIANTS, BiXT, create

DATA = Path(__file__).parent / "data"

# backbones.md section 0 (official code; BiXT-small D=384 from the paper's Table 5): with head, without head.
PARAMS = {
    "bixt_ti_l64_p16": (15_121_192, 14_928_192),
    "bixt_ti_l64_p16s8": (15_121_192, 14_928_192),
    "bixt_ti_l64_p16s4": (15_121_192, 14_928_192),
    "bixt_ti_l32_p16": (15_115_048, 14_922_048),
    "bixt_ti_l128_p16": (15_133_480, 14_940_480),
    "bixt_ti_l32_p16s8": (15_115_048, 14_922_048),
    "bixt_ti_l128_p16s8": (15_133_480, 14_940_480),
    "bixt_ti_l64_d13_p16": (16_381_672, 16_188_672),
    "bixt_s_l32_p16": (59_572_840, 59_187_840),
    "bixt_s_l64_p16": (59_585_128, 59_200_128),
    "bixt_s_l128_p16": (59_609_704, 59_224_704),
}

# A sample of the official state-dict keys of bixt_ti_l64_p16 (timm/models/bixt.py names) and their shapes.
OFFICIAL_KEYS_TI = {
    "patch_embed.proj.weight": (192, 3, 16, 16),
    "fourier_pos_encode.token_projection.weight": (192, 64, 1, 1),
    "latents": (1, 64, 192),
    "blocks.0.self_attention_latents.norm1.weight": (192,),
    "blocks.0.self_attention_latents.attn.qkv.weight": (576, 192),
    "blocks.0.self_attention_latents.attn.proj.weight": (192, 192),
    "blocks.0.self_attention_latents.mlp.fc1.weight": (768, 192),
    "blocks.0.cross_attention_latents_token.norm1_lat.weight": (192,),
    "blocks.0.cross_attention_latents_token.norm1_pat.bias": (192,),
    "blocks.0.cross_attention_latents_token.attn.rv_latents.weight": (384, 192),
    "blocks.0.cross_attention_latents_token.attn.rv_patches.bias": (384,),
    "blocks.0.cross_attention_latents_token.attn.proj_lat.weight": (192, 192),
    "blocks.0.cross_attention_latents_token.attn.proj_pat.weight": (192, 192),
    "blocks.10.cross_attention_latents_token.mlp_pat.fc2.weight": (192, 768),
    "blocks.10.cross_attention_latents_token.norm2_pat.weight": (192,),
    "blocks.11.cross_attention_latents_token.attn.r_latents.weight": (192, 192),
    "blocks.11.cross_attention_latents_token.attn.rv_patches.weight": (384, 192),
    "blocks.11.cross_attention_latents_token.norm1_pat.weight": (192,),
    "blocks.11.cross_attention_latents_token.mlp_lat.fc1.bias": (768,),
    "fc_norm.weight": (192,),
}


def fill(model: torch.nn.Module) -> None:
    """Deterministic non-trivial weights; the reference outputs in data/ were computed with these."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1 and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif p.ndim == 1:
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, p[0].numel() ** -0.5)


def image(size: int) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def tiny(**kw) -> BiXT:
    return BiXT(
        **{**dict(embed_dim=64, depth=3, num_heads=2, num_latents=8, name="bixt_tiny_test"), **kw}
    ).eval()


@pytest.fixture(scope="module")
def ti16():
    model = create("bixt_ti_l64_p16").eval()
    fill(model)
    return model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_counts_equal_the_official_code(name):
    with torch.device("meta"):
        headless, headed = create(name), create(name, num_classes=1000)
    assert sum(p.numel() for p in headed.parameters()) == PARAMS[name][0]
    assert sum(p.numel() for p in headless.parameters()) == PARAMS[name][1]


def test_state_dict_uses_the_official_names_and_shapes():
    with torch.device("meta"):
        state = create("bixt_ti_l64_p16").state_dict()
    assert {k: tuple(state[k].shape) for k in OFFICIAL_KEYS_TI} == OFFICIAL_KEYS_TI
    # the last layer is one-sided: no token update, so no token-side projection or MLP
    assert not any(k.startswith("blocks.11.") and ("proj_pat" in k or "mlp_pat" in k) for k in state)
    assert "fourier_pos_encode.pos" not in state


def test_official_checkpoints_with_the_fixed_grid_buffer_load_strictly(ti16):
    state = {**ti16.state_dict(), "fourier_pos_encode.pos": torch.zeros(64, 14, 14)}
    fresh = create("bixt_ti_l64_p16")
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(fresh.latents, ti16.latents)


@pytest.mark.parametrize("size", [96, 224])
def test_equals_the_official_model(ti16, size):
    """Reference values: the official BiXT built at ``img_size=size`` with these weights (``pre_logits``)."""
    expected = torch.tensor(
        json.loads((DATA / "bixt_ti_l64_p16_reference.json").read_text())["embedding"][str(size)]
    )
    with torch.no_grad():
        out = ti16(image(size))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_fourier_encoding_is_the_official_fixed_grid_one():
    """Dynamic encoding at 14 x 14 equals the official precomputed buffer's formula (y then x, sin/cos)."""
    model = tiny()
    feats = model.fourier_pos_encode.fourier_features(14, 14, torch.device("cpu")).t().reshape(64, 14, 14)
    y = torch.arange(1, 15, dtype=torch.float32) / (14 + 1e-6) * 2 * torch.pi
    dim_t = 10000 ** (2 * (torch.arange(32) // 2) / 32)
    assert torch.allclose(feats[0, :, 0], (y / dim_t[0]).sin())
    assert torch.allclose(feats[33, 0, :], (y / dim_t[1]).cos())


@pytest.mark.parametrize(
    ("stride", "size"), [(16, (96, 96)), (16, (224, 224)), (16, (96, 160)), (8, (96, 96))]
)
def test_shapes_and_dense_grid_at_any_multiple_of_the_stride(stride, size):
    model = tiny(stride=stride)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        emb = model(x)
        tokens, grid = model.forward_patch_tokens(x)
        latents = model.forward_features(x)
    assert isinstance(model, Backbone) and model.family == "bixt" and model.size_multiple == stride
    assert emb.shape == (2, 64) and latents.shape == (2, 8, 64)
    assert grid == (size[0] // stride, size[1] // stride)
    assert tokens.shape == (2, grid[0] * grid[1], 64)


def test_dense_tokens_are_the_last_bidirectional_outputs_normed():
    model = tiny()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        tokens, _ = model.forward_patch_tokens(x)
        last_bidir = model.get_intermediate_layers(x, 1)[0]
    norm = model.blocks[-1].cross_attention_latents_token.norm1_pat
    torch.testing.assert_close(tokens, norm(last_bidir))


def test_batch_items_are_independent_and_latents_broadcast():
    model = tiny()
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        together = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_intermediate_cls_and_attention_maps():
    model = tiny()
    x = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        cls = model.get_intermediate_cls(x, 2)
        emb = model(x)
        maps, grid = model.get_attention_maps(x)
    torch.testing.assert_close(cls[-1], emb)
    assert grid == (4, 5) and len(maps) == 3
    for m in maps:  # mean over latents of softmaxes over tokens: a distribution over the grid per head
        assert m.shape == (2, 2, 20)
        torch.testing.assert_close(m.sum(-1), torch.ones(2, 2))
    with pytest.raises(
        ValueError, match=r"out of range for bixt_tiny_test with 2 blocks \(bi-directional layers 0 \.\. 1\)"
    ):
        model.get_intermediate_layers(x, [2])


def test_gradients_reach_every_parameter():
    model = tiny().train()
    model(torch.randn(2, 3, 48, 64)).pow(2).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


@pytest.mark.parametrize(("stride", "size"), [(16, (100, 96)), (16, (224, 232)), (8, (92, 96))])
def test_sizes_off_the_token_stride_are_rejected(stride, size):
    model = tiny(stride=stride)
    with pytest.raises(
        ValueError, match=rf"input size {size[0]}x{size[1]} .*multiples of {stride}.*stride is {stride}"
    ):
        model(torch.randn(1, 3, *size))


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="bixt_ti_l64_p16, bixt_ti_l64_p16s8"):
        create("bixt_xl")


def test_drop_path_rate_sets_both_streams_linearly():
    model = tiny(depth=3, drop_path_rate=0.2)
    last = model.blocks[-1]
    assert last.self_attention_latents.drop_path1.drop_prob == pytest.approx(0.2)
    assert last.cross_attention_latents_token.drop_path1_lat.drop_prob == pytest.approx(0.2)
    assert model.blocks[1].cross_attention_latents_token.drop_path1_pat.drop_prob == pytest.approx(0.1)
    assert isinstance(model.blocks[0].self_attention_latents.drop_path1, torch.nn.Identity)


@pytest.mark.parametrize(("size", "paper"), [(224, 1.68), (96, 0.86)])
def test_macs_match_the_paper(ti16, size, paper):
    """backbones.md 0 (fvcore): 1.68 G at 224, 0.86 G at 96. torch's counter misses the CPU-fused latent
    self-attention (12 x 2 x 64^2 x 192 = 0.019 G) and fvcore adds a few element-wise ops: 0.03 G slack."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ti16(torch.randn(1, 3, size, size))
    assert counter.get_total_flops() / 2e9 == pytest.approx(paper, abs=0.03)
