"""The frozen teacher's tokens (ssl_xcit.dino.distill_teacher): a timm teacher without a class token gives its
pooled embedding as the CLS target, never a patch token; one with neither is refused in one line."""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from ssl_xcit.dino.distill import FrozenTeacher
from ssl_xcit.errors import UserError


def _vit(**kwargs) -> VisionTransformer:
    """A tiny timm ViT (32 px, 8-px patches: a 4x4 grid) from random weights, headless."""
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=0,
                             dynamic_img_size=True, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, prefix",
    [
        (dict(class_token=False, global_pool="map"), 0),  # SigLIP's layout: attention pool, no CLS
        (dict(class_token=False, reg_tokens=2, global_pool="avg"), 2),  # registers, average pool
    ],
    ids=["attention-pool", "registers-avg"],
)
def test_a_teacher_without_a_class_token_gives_its_pooled_embedding(kwargs, prefix):
    model = _vit(**kwargs)
    teacher = FrozenTeacher(model, "timm:tiny", probe_size=32)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    cls, patches = teacher.tokens(x)
    with torch.no_grad():
        tokens = model.forward_features(x)
        pooled = model.forward_head(tokens, pre_logits=True)
    assert torch.equal(cls, pooled)  # the pool ran: not the first token
    assert not torch.allclose(cls, tokens[:, 0])
    assert patches.shape == (2, 4, 4, 32)
    assert torch.equal(patches.reshape(2, 16, 32), tokens[:, prefix:])  # every patch, no prefix token
    assert (teacher.cls_dim, teacher.patch_dim) == (32, 32)


def test_a_teacher_with_a_class_token_keeps_it():
    model = _vit(class_token=True, global_pool="token")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    cls, patches = FrozenTeacher(model, "timm:tiny", probe_size=32).tokens(x)
    with torch.no_grad():
        tokens = model.forward_features(x)
    assert torch.equal(cls, tokens[:, 0])
    assert torch.equal(patches.reshape(2, 16, 32), tokens[:, 1:])


def test_a_teacher_with_neither_class_token_nor_pool_is_refused_in_one_line():
    with pytest.raises(UserError) as error:
        FrozenTeacher(_vit(class_token=False, global_pool=""), "timm:tiny", probe_size=32)
    message = str(error.value)
    assert "\n" not in message
    assert "no class token" in message and "global_pool ''" in message
