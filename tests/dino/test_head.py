from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ssl_xcit.dino.head import DINOHead, WeightNormLinear


def test_head_shapes_keys_and_frozen_weight_g():
    head = DINOHead(384, 65536)
    keys = set(head.state_dict())
    assert keys == {
        "mlp.0.weight",
        "mlp.0.bias",
        "mlp.2.weight",
        "mlp.2.bias",
        "mlp.4.weight",
        "mlp.4.bias",
        "last_layer.weight_g",
        "last_layer.weight_v",
    }
    assert head.last_layer.weight_g.shape == (65536, 1) and head.last_layer.weight_v.shape == (65536, 256)
    assert not head.last_layer.weight_g.requires_grad
    assert torch.all(head.last_layer.weight_g == 1)
    # 22.352M parameters in the reference (weight_g included)
    assert sum(p.numel() for p in head.parameters()) == 22_352_128
    assert head(torch.randn(3, 384)).shape == (3, 65536)
    assert isinstance(head.mlp[1], nn.GELU) and isinstance(head.mlp[3], nn.GELU)
    assert head.mlp[0].bias.detach().abs().sum() == 0 and float(
        head.mlp[0].weight.detach().std()
    ) == pytest.approx(0.02, rel=0.05)


def test_head_options():
    head = DINOHead(16, 32, use_bn=True, norm_last_layer=False, hidden_dim=8, bottleneck_dim=4)
    assert head.last_layer.weight_g.requires_grad
    assert isinstance(head.mlp[1], nn.BatchNorm1d)
    assert DINOHead(16, 32, nlayers=1, bottleneck_dim=4).mlp.out_features == 4


def test_weight_norm_linear_matches_torch_legacy_weight_norm():
    layer = WeightNormLinear(8, 5)
    with torch.no_grad():
        layer.weight_g.uniform_(0.5, 2.0)
    legacy = nn.Linear(8, 5, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = nn.utils.weight_norm(legacy)
    legacy.load_state_dict(layer.state_dict())  # identical keys: weight_g, weight_v
    x = torch.randn(4, 8)
    torch.testing.assert_close(layer(x), legacy(x))
    # Gradients match as well.
    layer(x).sum().backward()
    legacy(x).sum().backward()
    torch.testing.assert_close(layer.weight_v.grad, legacy.weight_v.grad)
    torch.testing.assert_close(layer.weight_g.grad, legacy.weight_g.grad)


def test_head_output_is_cosine_when_norm_last_layer():
    head = DINOHead(16, 10, hidden_dim=8, bottleneck_dim=4)
    out = head(torch.randn(6, 16))
    assert out.abs().max() <= 1.0 + 1e-5  # unit bottleneck . unit prototypes
