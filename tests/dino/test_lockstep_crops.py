"""The student's crop groups in one backbone call (``MultiCropWrapper.lockstep_crops``, what FSDP2's sharding
turns on so that each block is gathered twice a step: tests/trainer/test_fsdp2_gathers.py) against the call per
group DINO makes otherwise: without drop path, outputs, patch tokens, every gradient and BatchNorm's running
statistics are bitwise the same in float32, with iBOT's masks on the global crops (families that take them) and 2
local crops of another size, for every family."""

from __future__ import annotations

import copy

import pytest
import torch

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.multicrop import MultiCropWrapper
from ssl_xcit.models import create_model
from ssl_xcit.models.activation_checkpointing import blocks

# name -> (backbone kwargs, crop sides: 2 global then 2 local)
BACKBONES = {
    "xcit_nano_12_p8": ({"depth": 2}, (32, 16)),  # BatchNorm in its stem and every block
    "vit_tiny_patch16_224": ({"depth": 2, "patch_size": 8}, (32, 16)),  # no BatchNorm
    # RoPE per input, no BatchNorm
    "vit_small_patch16_dinov3": ({"embed_dim": 32, "depth": 2, "num_heads": 2}, (32, 16)),
    "cait_xxs24": ({"depth": 2, "patch_size": 8}, (32, 16)),  # class-attention blocks take the class tokens
    # blocks inside stages, downsampling (root unit) between; no masks
    "convnext_tiny": ({"depths": (1, 1, 2, 1), "dims": (8, 16, 24, 32)}, (64, 32)),
    # blocks take their grid sides (SDA and LDA blocks, an ACL block, merges between stages); no masks
    "crossformerpp_small": ({"embed_dim": 32, "depths": (4, 1, 1, 1)}, (64, 32)),
    # blocks take the latents and the tokens; no masks
    "bixt_ti_l64_p16": ({"depth": 2, "embed_dim": 32, "num_heads": 2, "num_latents": 8}, (32, 16)),
}
BATCH = 2


def _pair(name: str) -> tuple[MultiCropWrapper, MultiCropWrapper]:
    torch.manual_seed(0)
    backbone = create_model(name, drop_path_rate=0.0, **BACKBONES[name][0])
    if backbone.supports_masking:
        backbone.enable_masking()
        with torch.no_grad():
            backbone.mask_token.normal_()
    head = DINOHead(backbone.embed_dim, 16, hidden_dim=16, bottleneck_dim=8)
    plain = MultiCropWrapper(
        backbone, head, DINOHead(backbone.embed_dim, 16, hidden_dim=16, bottleneck_dim=8)
    )
    lockstep = copy.deepcopy(plain)
    lockstep.lockstep_crops = True
    assert plain.backbone.takes_input_lists and not plain.lockstep_crops
    return plain.train(), lockstep.train()


def _crops_and_masks(name: str, model: MultiCropWrapper) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The crops, and iBOT's masks of the global ones where the family takes masks (else None)."""
    gen = torch.Generator().manual_seed(1)
    big, small = BACKBONES[name][1]
    crops = [torch.randn(BATCH, 3, s, s, generator=gen) for s in (big, big, small, small)]
    if not model.backbone.supports_masking:
        return crops, None
    h, w = model.backbone.token_grid(big, big)
    masks = torch.rand(2 * BATCH, h * w, generator=gen) < 0.4
    masks[0] = False  # one global crop unmasked: ibot_bn_stats takes its statistics from it
    return crops, masks


def _step(model: MultiCropWrapper, crops, masks, bn_from_unmasked: bool = False):
    """A step with the patch tokens where the family gives them (``forward_with_patches``), else DINO's."""
    calls = []
    hooks = [b.register_forward_hook(lambda *_: calls.append(1)) for b in blocks(model.backbone)]
    backbone = model.backbone
    try:
        if backbone.supports_masking or backbone.gives_patch_tokens:
            out, embedding, patches = model.forward_with_patches(
                crops, masks, bn_from_unmasked=bn_from_unmasked
            )
        else:
            (out, embedding), patches = model(crops, return_embeddings=True), None
    finally:
        for hook in hooks:
            hook.remove()
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + embedding.square().sum()
    if patches is not None:
        selected = patches[masks] if masks is not None else patches.flatten(0, 1)
        loss = loss + model.patch_logits(selected).square().mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    values = [out, embedding] + ([patches] if patches is not None else [])
    return values, grads, dict(model.named_buffers()), len(calls)


def _assert_bitwise(a, b) -> None:
    assert a.keys() == b.keys() if isinstance(a, dict) else len(a) == len(b)
    for key in a if isinstance(a, dict) else range(len(a)):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(BACKBONES))
def test_lockstep_crops_equal_a_call_per_group_bitwise(name):
    """Each block is called once a step for the 2 groups instead of twice, with bitwise the same results."""
    plain, lockstep = _pair(name)
    crops, masks = _crops_and_masks(name, plain)
    values, grads, buffers, calls = _step(plain, crops, masks)
    values_l, grads_l, buffers_l, calls_l = _step(lockstep, crops, masks)
    depth = len(blocks(plain.backbone))
    assert (calls, calls_l) == (2 * depth, depth)
    _assert_bitwise(values, values_l)
    # every backbone parameter has a gradient, the mask token's too
    assert {n for n in grads if n.startswith("backbone.")} == {
        f"backbone.{n}" for n, _ in plain.backbone.named_parameters()
    }
    _assert_bitwise(grads, grads_l)
    _assert_bitwise(buffers, buffers_l)  # XCiT's BatchNorm running statistics: each group's own
    # the list forward gives each input's patch tokens (the final-norm tokens: CrossFormer++'s stage 4, BiXT's
    # tokens after its last bi-directional layer, unnormed), of each input's own grid
    passes = lockstep.backbone.forward_cls_patches_list(crops[::2])
    grids = [plain.backbone.token_grid(*c.shape[-2:]) for c in crops[::2]]
    assert [p.shape[:2] for _, p in passes] == [(BATCH, h * w) for h, w in grids]


@pytest.mark.parametrize("name", list(BACKBONES))
def test_lockstep_crops_without_ibot_equal_a_call_per_group_bitwise(name):
    """DINO without iBOT (``forward``, the embeddings of each group)."""
    plain, lockstep = _pair(name)
    crops, _ = _crops_and_masks(name, plain)
    results = []
    for model in (plain, lockstep):
        out, embedding = model(crops, return_embeddings=True)
        (out.square().sum() + embedding.sum()).backward()
        results.append(
            ([out, embedding], {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        )
    _assert_bitwise(results[0][0], results[1][0])
    _assert_bitwise(results[0][1], results[1][1])


@pytest.mark.parametrize(
    "name",
    ["xcit_nano_12_p8", "vit_small_patch16_dinov3", "cait_xxs24", "convnext_tiny", "crossformerpp_small",
     "bixt_ti_l64_p16"],
)  # fmt: skip
def test_lockstep_crops_with_activation_checkpointing_equal_a_call_per_group_bitwise(name):
    """Checkpointed blocks (``--model.activation_checkpointing``) recompute the list of inputs in the backward."""
    from ssl_xcit.models.activation_checkpointing import enable_activation_checkpointing

    plain, lockstep = _pair(name)
    for model in (plain, lockstep):
        enable_activation_checkpointing(model.backbone)
    crops, masks = _crops_and_masks(name, plain)
    values, grads, buffers, _ = _step(plain, crops, masks)
    values_l, grads_l, buffers_l, _ = _step(lockstep, crops, masks)
    _assert_bitwise(values, values_l)
    _assert_bitwise(grads, grads_l)
    _assert_bitwise(buffers, buffers_l)


def test_masked_batchnorm_statistics_stay_with_the_global_crops():
    """``ibot_bn_stats: unmasked`` (``statistics_from_unmasked``) in one call with the local crops: it applies
    to the masked global group only, though the 2 local crops make a batch of the same size (which the statistics
    are otherwise chosen by); the local group keeps its plain statistics, as in its own call."""
    plain, lockstep = _pair("xcit_nano_12_p8")
    crops, masks = _crops_and_masks("xcit_nano_12_p8", plain)
    assert sum(c.shape[0] for c in crops[2:]) == masks.shape[0]
    values, grads, buffers, _ = _step(plain, crops, masks, bn_from_unmasked=True)
    values_l, grads_l, buffers_l, _ = _step(lockstep, crops, masks, bn_from_unmasked=True)
    _assert_bitwise(values, values_l)
    _assert_bitwise(grads, grads_l)
    _assert_bitwise(buffers, buffers_l)
    # and it did change the masked pass: plain statistics give other running means
    reference, _ = _pair("xcit_nano_12_p8")
    _, _, plain_buffers, _ = _step(reference, crops, masks)
    assert not torch.equal(
        plain_buffers["backbone.patch_embed.proj.0.1.running_mean"],
        buffers_l["backbone.patch_embed.proj.0.1.running_mean"],
    )


def test_lockstep_is_off_by_default_and_ignored_by_other_blocks():
    """Off unless asked (drop path's random draws come in another order); a backbone whose blocks take one
    tensor (a timm ViT built with another block class) keeps its call per group when asked."""
    from timm.models.vision_transformer import ResPostBlock

    assert MultiCropWrapper.lockstep_crops is False
    backbone = create_model("vit_tiny_patch16_224", depth=1, patch_size=8, block_fn=ResPostBlock)
    model = MultiCropWrapper(backbone, DINOHead(backbone.embed_dim, 8, hidden_dim=8, bottleneck_dim=8))
    model.lockstep_crops = True
    assert not backbone.takes_input_lists and not model._lockstep()
    crops = [torch.randn(1, 3, s, s) for s in (16, 16, 8)]
    assert model(crops).shape == (3, 8)
