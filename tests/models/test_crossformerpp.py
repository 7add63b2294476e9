"""CrossFormer++: parameter counts, official parameter names, equivalence with the official code, any size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ssl_xcit.models.base import Backbone
from ssl_xcit.models.crossformerpp import VARIANTS, CrossFormerPP, create

DATA = Path(__file__).parent / "data"

# backbones.md section 0: the official code's counts, with the 1000-class head and without it.
PARAMS = {
    "crossformerpp_small": (23_325_340, 22_812_340),
    "crossformerpp_base": (51_994_594, 51_225_594),
    "crossformerpp_large": (92_001_904, 90_976_904),
    "crossformerpp_huge": (95_962_944, 94_937_944),
}

# A sample of the official state-dict keys of CrossFormer++-S (models/crossformer.py names) and their shapes.
OFFICIAL_KEYS_S = {
    "patch_embed.projs.0.weight": (32, 3, 4, 4),
    "patch_embed.projs.1.weight": (16, 3, 8, 8),
    "patch_embed.projs.2.weight": (8, 3, 16, 16),
    "patch_embed.projs.3.weight": (8, 3, 32, 32),
    "patch_embed.norm.weight": (64,),
    "layers.0.blocks.0.norm1.weight": (64,),
    "layers.0.blocks.0.attn.pos.pos_proj.weight": (4, 2),
    "layers.0.blocks.0.attn.pos.pos1.0.weight": (4,),
    "layers.0.blocks.0.attn.pos.pos1.2.weight": (4, 4),
    "layers.0.blocks.1.attn.pos.pos3.2.weight": (2, 4),
    "layers.0.blocks.1.attn.qkv.weight": (192, 64),
    "layers.0.blocks.1.attn.proj.bias": (64,),
    "layers.0.blocks.1.mlp.fc1.weight": (256, 64),
    "layers.0.downsample.norm.weight": (64,),
    "layers.0.downsample.reductions.0.weight": (64, 64, 2, 2),
    "layers.0.downsample.reductions.1.weight": (64, 64, 4, 4),
    "layers.2.blocks.2.ex_conv.weight": (256, 1, 3, 3),
    "layers.2.blocks.2.ex_ln.bias": (256,),
    "layers.2.blocks.14.ex_conv.bias": (256,),
    "layers.2.downsample.reductions.1.weight": (256, 256, 4, 4),
    "layers.3.blocks.1.attn.pos.pos3.2.bias": (16,),
    "layers.3.blocks.1.mlp.fc2.weight": (512, 2048),
    "norm.weight": (512,),
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


def tiny(**kw) -> CrossFormerPP:
    """Reduced depth and width, same structure (SDA/LDA, ACL in stage 3, PGS, padding)."""
    args = dict(embed_dim=32, depths=(2, 2, 3, 2), num_heads=(1, 2, 4, 8), name="crossformerpp_tiny_test")
    return CrossFormerPP(**{**args, **kw}).eval()


@pytest.fixture(scope="module")
def small():
    model = create("crossformerpp_small").eval()
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
        model = create("crossformerpp_small")
        huge = create("crossformerpp_huge")
    state = model.state_dict()
    assert {k: tuple(state[k].shape) for k in OFFICIAL_KEYS_S} == OFFICIAL_KEYS_S
    # ACL after blocks 3, 6, 9, 12, 15 of stage 3 only (S); H adds one in each of stages 1 and 2.
    assert sorted(k for k in state if k.endswith("ex_conv.weight")) == sorted(
        f"layers.2.blocks.{i}.ex_conv.weight" for i in (2, 5, 8, 11, 14)
    )
    assert sum(k.endswith("ex_conv.weight") for k in huge.state_dict()) == 7
    assert not any("relative_position_index" in k or "attn_mask" in k for k in state)  # no size-bound buffers


@pytest.mark.parametrize("size", [96, 224])
def test_equals_the_official_model_built_at_that_size(small, size):
    """Reference values: the official classification model constructed at ``img_size=size`` with these weights."""
    expected = torch.tensor(
        json.loads((DATA / "crossformerpp_small_reference.json").read_text())["embedding"][str(size)]
    )
    with torch.no_grad():
        out = small(image(size))
    assert out.shape == (2, 512)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_a_small_input_does_not_change_later_outputs(small):
    """The official detection backbone flips LDA to SDA in place after one small input; ours decides per call."""
    with torch.no_grad():
        before = small(image(224))
        small(image(96))
        after = small(image(224))
    torch.testing.assert_close(before, after, atol=0, rtol=0)


@pytest.mark.parametrize("size", [(96, 96), (224, 224), (96, 160), (768, 768)])
def test_shapes_and_dense_grid_at_any_multiple_of_32(size):
    model = tiny()
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        emb = model(x)
        tokens, grid = model.forward_patch_tokens(x)
        feats = model.forward_features(x)
    assert isinstance(model, Backbone) and model.family == "crossformerpp"
    assert emb.shape == (1, 256) and model.embed_dim == 256 and model.dense_dim == 128
    assert grid == (size[0] // 16, size[1] // 16)
    assert tokens.shape == (1, grid[0] * grid[1], 128)
    assert feats.shape == (1, (size[0] // 32) * (size[1] // 32), 256)
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), emb)


def test_dense_tokens_are_stage3_outputs_normed_by_the_next_merge_norm():
    model = tiny()
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        tokens, grid = model.forward_patch_tokens(x)
        stage3 = model.get_intermediate_layers(x, [sum(model.depths[:3]) - 1])[0]
    torch.testing.assert_close(tokens, model.layers[2].downsample.norm(stage3))
    assert grid == (6, 8)


def test_intermediates_index_all_blocks_and_the_last_cls_is_forward():
    model = tiny()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        layers = model.get_intermediate_layers(x, [0, 3, 8])
        cls = model.get_intermediate_cls(x, 2)
        emb = model(x)
    assert [t.shape for t in layers] == [(2, 256, 32), (2, 64, 64), (2, 4, 256)]
    assert [c.shape for c in cls] == [(2, 256), (2, 256)]
    torch.testing.assert_close(cls[-1], emb)
    with pytest.raises(ValueError, match=r"out of range .* 9 blocks"):
        model.get_intermediate_layers(x, [9])


def test_gradients_reach_every_parameter():
    model = tiny().train()
    model(torch.randn(2, 3, 64, 96)).pow(2).mean().backward()
    # the DPB's last bias adds one constant per head to every logit, which softmax cancels: no true gradient
    missing = [
        n
        for n, p in model.named_parameters()
        if not n.endswith("pos3.2.bias") and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    assert missing == []


@pytest.mark.parametrize("size", [(100, 96), (224, 240), (16, 16)])
def test_sizes_that_are_not_multiples_of_32_are_rejected(size):
    model = tiny()
    assert model.size_multiple == 32
    with pytest.raises(
        ValueError,
        match=rf"input size {size[0]}x{size[1]} .*multiples of 32 .*stride 4 and halves the map 3 times",
    ):
        model(torch.randn(1, 3, *size))


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="crossformerpp_small, crossformerpp_base"):
        create("crossformerpp_tiny")


def test_padding_masks_survive_half_precision():
    """Stage-1 LDA pads 24 -> 32 at 96 px; the -1e6 mask must not turn into -inf/NaN under bf16/fp16."""
    model = tiny().to(torch.bfloat16)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 96, 96, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_macs_at_224_match_the_paper(small):
    """backbones.md 0: 4.39 G (official flops()) / 4.45 G (fvcore) at 224; matmul+conv MACs land in between."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        small(torch.randn(1, 3, 224, 224))
    assert 4.39 <= counter.get_total_flops() / 2e9 <= 4.45


def test_checkpoints_with_size_bound_buffers_load_strictly():
    """v1-code checkpoints also hold the DPB offset table, index and mask buffers of one image size."""
    model = tiny()
    state = model.state_dict()
    state["layers.0.blocks.1.attn.biases"] = torch.zeros(49, 2)
    state["layers.0.blocks.1.attn.relative_position_index"] = torch.zeros(16, 16, dtype=torch.long)
    state["layers.0.blocks.1.attn_mask"] = torch.zeros(16, 16, 16)
    tiny().load_state_dict(state, strict=True)
    state["layers.0.blocks.1.attn.unknown"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="attn.unknown"):
        tiny().load_state_dict(state, strict=True)


def test_backward_after_an_inference_mode_forward():
    """The cached offset and padding tensors must not be inference tensors: a k-NN or predict pass (inference
    mode) before training used to make the next backward fail ("Inference tensors cannot be saved")."""
    from ssl_xcit.models import create_model
    from ssl_xcit.models.crossformerpp_layers import _padding_mask, _relative_offsets

    _relative_offsets.cache_clear()
    _padding_mask.cache_clear()
    model = create_model("crossformerpp_small", depths=(1, 1, 1, 1))
    x = torch.randn(1, 3, 96, 96)  # 24x24 at stride 4: padded groups, so the padding mask is cached too
    with torch.inference_mode():
        model(x)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
