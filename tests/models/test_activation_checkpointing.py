"""Activation checkpointing per block (``ssl_xcit.models.activation_checkpointing``): for every family, one DINO
training step gives the same loss, gradients and BatchNorm statistics with and without it, drop path on."""

from __future__ import annotations

import pytest
import torch

from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError
from ssl_xcit.models.activation_checkpointing import enable_activation_checkpointing

FAMILIES = [
    ("xcit_nano_12_p8", {"depth": 2}, (16, 8)),  # LPI BatchNorms inside the blocks
    ("cait_xxs24", {"depth": 1, "patch_size": 8}, (16, 8)),
    ("vit_tiny_patch16_224", {"depth": 2, "patch_size": 8}, (16, 8)),
    pytest.param("crossformerpp_small", {"depths": (1, 1, 1, 1)}, (32, 32), marks=pytest.mark.slow),
    pytest.param("bixt_ti_l64_p16", {"depth": 2}, (32, 16), marks=pytest.mark.slow),
]


def _step(name, kwargs, sides, checkpointing: bool):
    torch.manual_seed(0)
    model = DINO(name, backbone_kwargs=kwargs, drop_path_rate=0.2, out_dim=16, head_hidden_dim=16,
                 head_bottleneck_dim=8, activation_checkpointing=checkpointing)  # fmt: skip
    model.student.train()
    g = torch.Generator().manual_seed(1)
    crops = [torch.randn(3, 3, s, s, generator=g) for s in (sides[0], sides[0], sides[1], sides[1])]
    torch.manual_seed(2)  # the drop path draws
    out = model.compute_losses(crops, None, epoch=0, update_center=False)
    out.total.backward()
    grads = {k: p.grad.clone() for k, p in model.student.named_parameters() if p.grad is not None}
    return out.total.detach(), grads, {k: v.clone() for k, v in model.student.state_dict().items()}


@pytest.mark.parametrize("name,kwargs,sides", FAMILIES, ids=["xcit", "cait", "vit", "crossformerpp", "bixt"])
def test_checkpointed_blocks_give_the_same_step(name, kwargs, sides):
    loss, grads, state = _step(name, kwargs, sides, checkpointing=False)
    loss_ac, grads_ac, state_ac = _step(name, kwargs, sides, checkpointing=True)
    assert torch.equal(loss, loss_ac)
    assert grads.keys() == grads_ac.keys() and len(grads) > 10
    for key, value in grads.items():
        torch.testing.assert_close(grads_ac[key], value, rtol=1e-6, atol=1e-8, msg=key)
    assert state.keys() == state_ac.keys()  # parameter names unchanged
    for key, value in state.items():  # running statistics moved once, not twice
        assert torch.equal(state_ac[key], value), key


def test_a_backbone_without_blocks_is_refused():
    with pytest.raises(UserError, match="found no blocks in Linear"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))
