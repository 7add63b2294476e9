"""The student's crop groups in one backbone call (``MultiCropWrapper.lockstep_crops``, what FSDP2's sharding
turns on so that each block is gathered twice a step: tests/trainer/test_fsdp2_gathers.py) against the call per
group DINO makes otherwise: without drop path, outputs, patch tokens, every gradient and BatchNorm's running
statistics are bitwise the same in float32, with iBOT's masks on the global crops and 2 local crops of
another size."""

from __future__ import annotations

import copy

import pytest
import torch

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.multicrop import MultiCropWrapper
from ssl_xcit.models import create_model

BACKBONES = {
    "xcit_nano_12_p8": {"depth": 2},  # BatchNorm in its stem and every block
    "vit_tiny_patch16_224": {"depth": 2, "patch_size": 8},  # no BatchNorm
    "vit_small_patch16_dinov3": {"embed_dim": 32, "depth": 2, "num_heads": 2},  # RoPE per input, no BatchNorm
}
BATCH = 2


def _pair(name: str) -> tuple[MultiCropWrapper, MultiCropWrapper]:
    torch.manual_seed(0)
    backbone = create_model(name, drop_path_rate=0.0, **BACKBONES[name])
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


def _crops_and_masks(model: MultiCropWrapper) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    crops = [torch.randn(BATCH, 3, s, s, generator=gen) for s in (32, 32, 16, 16)]
    h, w = model.backbone.token_grid(32, 32)
    masks = torch.rand(2 * BATCH, h * w, generator=gen) < 0.4
    masks[0] = False  # one global crop unmasked: ibot_bn_stats takes its statistics from it
    return crops, masks


def _step(model: MultiCropWrapper, crops, masks, bn_from_unmasked: bool = False):
    calls = []
    hooks = [b.register_forward_hook(lambda *_: calls.append(1)) for b in model.backbone.blocks]
    try:
        out, embedding, patches = model.forward_with_patches(crops, masks, bn_from_unmasked=bn_from_unmasked)
    finally:
        for hook in hooks:
            hook.remove()
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + model.patch_logits(
        patches[masks]
    ).square().mean()
    loss = loss + embedding.square().sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return [out, embedding, patches], grads, dict(model.named_buffers()), len(calls)


def _assert_bitwise(a, b) -> None:
    assert a.keys() == b.keys() if isinstance(a, dict) else len(a) == len(b)
    for key in a if isinstance(a, dict) else range(len(a)):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(BACKBONES))
def test_lockstep_crops_equal_a_call_per_group_bitwise(name):
    """Each block is called once a step for the 2 groups instead of twice, with bitwise the same results."""
    plain, lockstep = _pair(name)
    crops, masks = _crops_and_masks(plain)
    values, grads, buffers, calls = _step(plain, crops, masks)
    values_l, grads_l, buffers_l, calls_l = _step(lockstep, crops, masks)
    depth = len(plain.backbone.blocks)
    assert (calls, calls_l) == (2 * depth, depth)
    _assert_bitwise(values, values_l)
    # every backbone parameter has a gradient, the mask token's too
    assert {n for n in grads if n.startswith("backbone.")} == {
        f"backbone.{n}" for n, _ in plain.backbone.named_parameters()
    }
    _assert_bitwise(grads, grads_l)
    _assert_bitwise(buffers, buffers_l)  # XCiT's BatchNorm running statistics: each group's own


@pytest.mark.parametrize("name", list(BACKBONES))
def test_lockstep_crops_without_ibot_equal_a_call_per_group_bitwise(name):
    """DINO without iBOT (``forward``, the embeddings of each group)."""
    plain, lockstep = _pair(name)
    crops, _ = _crops_and_masks(plain)
    results = []
    for model in (plain, lockstep):
        out, embedding = model(crops, return_embeddings=True)
        (out.square().sum() + embedding.sum()).backward()
        results.append(
            ([out, embedding], {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        )
    _assert_bitwise(results[0][0], results[1][0])
    _assert_bitwise(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["xcit_nano_12_p8", "vit_small_patch16_dinov3"])
def test_lockstep_crops_with_activation_checkpointing_equal_a_call_per_group_bitwise(name):
    """Checkpointed blocks (``--model.activation_checkpointing``) recompute the list of inputs in the backward."""
    from ssl_xcit.models.activation_checkpointing import enable_activation_checkpointing

    plain, lockstep = _pair(name)
    for model in (plain, lockstep):
        enable_activation_checkpointing(model.backbone)
    crops, masks = _crops_and_masks(plain)
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
    crops, masks = _crops_and_masks(plain)
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


def test_lockstep_is_off_by_default_and_ignored_by_other_families():
    """Off unless asked (drop path's random draws come in another order); a family whose blocks take one tensor
    (CaiT) keeps its call per group when asked."""
    assert MultiCropWrapper.lockstep_crops is False
    backbone = create_model("cait_xxs24", depth=1, patch_size=8)
    model = MultiCropWrapper(backbone, DINOHead(backbone.embed_dim, 8, hidden_dim=8, bottleneck_dim=8))
    model.lockstep_crops = True
    assert not backbone.takes_input_lists and not model._lockstep()
    crops = [torch.randn(1, 3, s, s) for s in (16, 16, 8)]
    assert model(crops).shape == (3, 8)
