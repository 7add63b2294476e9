"""Same weights, same outputs as timm's reference XCiT, forward and backward, at several sizes."""

from __future__ import annotations

import functools

import pytest
import timm
import torch

from ssl_xcit.models import create_model


@functools.cache
def _pair(name: str, seed: int = 0):
    torch.manual_seed(seed)
    reference = timm.create_model(name + "_224", num_classes=0)
    with torch.no_grad():  # move every weight, running stat and LayerScale away from its init
        for value in reference.state_dict().values():
            if value.dtype.is_floating_point:
                value.add_(torch.randn_like(value) * 0.05)
                if value.ndim == 1:
                    value.abs_()  # keeps running_var positive
    ours = create_model(name)
    ours.load_state_dict(reference.state_dict(), strict=True)
    return ours, reference


# XCA has two code paths: tokens <= channels (96 px: 36 tokens) and tokens > channels (nano at 192 px: 144
# tokens > 128 channels), where the attention is folded into the output projection.
CASES = [
    ("xcit_nano_12_p16", (192, 192)),
    ("xcit_nano_12_p16", (96, 96)),
    ("xcit_nano_12_p16", (160, 320)),
    ("xcit_tiny_12_p8", (96, 128)),
    ("xcit_tiny_24_p16", (64, 64)),
    ("xcit_small_12_p16", (64, 96)),
]


@pytest.mark.parametrize("name,size", CASES)
def test_eval_outputs_equal_timm(name, size):
    ours, reference = _pair(name)
    ours.eval(), reference.eval()
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        assert (ours(x) - reference(x)).abs().max() <= 1e-5
        assert (ours.forward_features(x) - reference.forward_features(x)).abs().max() <= 1e-5


@pytest.mark.parametrize("name,size", [("xcit_nano_12_p16", (192, 192)), ("xcit_nano_12_p16", (96, 96))])
def test_train_mode_forward_and_gradients_equal_timm(name, size):
    ours, reference = _pair(name)
    ours.train(), reference.train()
    ours.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)
    bn_before = reference.blocks[3].local_mp.bn.running_var.clone()
    x = torch.randn(3, 3, *size)
    out_ours, out_ref = ours(x), reference(x)
    assert (out_ours - out_ref).abs().max() <= 1e-5
    out_ours.pow(2).sum().backward()
    out_ref.pow(2).sum().backward()
    grads_ref = dict(reference.named_parameters())
    for key, param in ours.named_parameters():
        expected = grads_ref[key].grad
        # fp32 sums run in another order; the class-attention key biases have an exactly-zero true gradient
        # (a constant shift of every logit), so both sides hold ~1e-8 noise there: hence the absolute floor.
        tolerance = 1e-3 * expected.abs().max().item() + 1e-6
        assert (param.grad - expected).abs().max().item() <= tolerance, key
    # BatchNorm running statistics move, and identically.
    bn_ours = ours.blocks[3].local_mp.bn.running_var
    assert not torch.allclose(bn_before, bn_ours)
    assert torch.allclose(bn_ours, reference.blocks[3].local_mp.bn.running_var, atol=1e-6)
