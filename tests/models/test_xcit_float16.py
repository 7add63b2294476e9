"""XCiT under float16 autocast (``16-mixed``): finite and close to float32, at one token and at several.

Before XCA normalised q and k first under float16, its raw Gram matrix divided by |q_i| |k_j| gave NaN in the
forward and backward of a one-token input (an 8-px local crop at patch 8), which the invariant matrix's
``16-mixed`` XCiT rows hit at step 0.
"""

from __future__ import annotations

import pytest
import torch

from ssl_xcit.models.layers import XCA
from ssl_xcit.models.xcit import VARIANTS, XCiT


def _run(model: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor, half: bool):
    model.zero_grad()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        out = model(x)
    (out.float() * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.float().detach(), x.grad, grads


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(a).all()
    err = (a.float() - b).norm() / b.norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.3g} over {tol}"


@pytest.mark.parametrize("tokens", [1, 4])
def test_xca_float16_autocast_is_finite_and_close_to_float32(tokens: int) -> None:
    torch.manual_seed(0)
    attn = XCA(64, 4, qkv_bias=True)
    x = torch.randn(4, tokens, 64) * 0.05  # small tokens: |q_i| |k_j| is below float16's normal range
    weights = torch.randn(4, tokens, 64)
    out16, dx16, g16 = _run(attn, x, weights, half=True)
    out32, dx32, g32 = _run(attn, x, weights, half=False)
    _close(out16, out32, 1e-2)
    _close(dx16, dx32, 2e-2)
    for name, grad in g32.items():
        _close(g16[name], grad, 2e-2)


@pytest.mark.parametrize("side", [8, 16])
def test_xcit_float16_autocast_forward_backward_finite_and_close(side: int) -> None:
    """The matrix's XCiT (nano, patch 8, one block) on its crop sizes: 1 and 4 patch tokens."""
    torch.manual_seed(0)
    model = XCiT(**dict(VARIANTS["xcit_nano_12_p8"], depth=1)).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, side, side, generator=g) + 1
    weights = torch.randn(4, model.embed_dim, generator=g)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out16, _, g16 = _run(model, x, weights, half=True)
    model.load_state_dict(state)  # the same BatchNorm running statistics for both runs
    out32, _, g32 = _run(model, x, weights, half=False)
    _close(out16, out32, 2e-2)
    assert g16.keys() == g32.keys()
    # One vector over all parameters: some tensors' true gradients are 0 (class attention's key bias shifts
    # every logit alike; at one token XCA's cosines are +-1 whatever q and k), where float32 holds only noise.
    _close(torch.cat([g16[n].flatten() for n in g32]), torch.cat([g.flatten() for g in g32.values()]), 1e-2)
