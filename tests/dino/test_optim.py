from __future__ import annotations

import pytest
import torch
from torch import nn

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.optim import (
    LARS,
    build_optimizer,
    cancel_gradients_last_layer,
    clip_gradients,
    get_params_groups,
)
from ssl_xcit.models import create_model


def test_param_groups_no_weight_decay_on_biases_and_1d():
    model = nn.ModuleDict(
        {"backbone": create_model("xcit_nano_12_p16", depth=1), "head": DINOHead(128, 64, hidden_dim=32)}
    )
    groups = get_params_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    reg = {names[id(p)] for p in groups[0]["params"]}
    noreg = {names[id(p)] for p in groups[1]["params"]}
    assert groups[1]["weight_decay"] == 0.0 and "weight_decay" not in groups[0]
    assert all(n.endswith(".bias") or model.get_parameter(n).ndim == 1 for n in noreg)
    assert any(n.endswith("norm1.weight") for n in noreg) and any("gamma1" in n for n in noreg)
    # As in the reference: cls_token and the (h,1,1) attention temperatures are regularised.
    assert "backbone.cls_token" in reg and any(n.endswith("attn.temperature") for n in reg)
    assert "head.mlp.0.weight" in reg
    # frozen weight_g is in no group
    assert "head.last_layer.weight_g" not in reg | noreg
    assert len(reg) + len(noreg) == sum(p.requires_grad for p in model.parameters())


def test_per_parameter_clipping_matches_reference_rule():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    model = nn.ParameterList([a, b])
    a.grad = torch.tensor([3.0, 4.0, 0.0])  # norm 5 -> clipped to 3
    b.grad = torch.tensor([[0.1, 0.2], [0.0, 0.2]])  # norm 0.3 -> untouched
    norms = clip_gradients(model, 3.0)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.3]))
    torch.testing.assert_close(a.grad, torch.tensor([3.0, 4.0, 0.0]) * (3.0 / (5.0 + 1e-6)))
    torch.testing.assert_close(b.grad, torch.tensor([[0.1, 0.2], [0.0, 0.2]]))  # not a global-norm clip


def test_cancel_last_layer_gradients():
    head = DINOHead(4, 6, norm_last_layer=False, hidden_dim=8, bottleneck_dim=4)
    head(torch.randn(2, 4)).sum().backward()
    cancel_gradients_last_layer(epoch=0, model=head, freeze_last_layer=1)
    assert head.last_layer.weight_v.grad is None and head.last_layer.weight_g.grad is None
    assert head.mlp[0].weight.grad is not None
    head(torch.randn(2, 4)).sum().backward()
    cancel_gradients_last_layer(epoch=1, model=head, freeze_last_layer=1)
    assert head.last_layer.weight_v.grad is not None


def test_build_optimizers_and_lars_step():
    params = [nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))]
    groups = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}]
    assert isinstance(build_optimizer("adamw", groups), torch.optim.AdamW)
    assert isinstance(build_optimizer("SGD", groups), torch.optim.SGD)
    opt = build_optimizer("lars", groups)
    assert isinstance(opt, LARS)
    for g in opt.param_groups:
        g["lr"] = 0.1
    opt.param_groups[0]["weight_decay"] = 0.0
    params[0].grad = torch.full((2, 2), 0.5)
    params[1].grad = torch.full((2,), 0.5)
    opt.step()
    # 2-D: update scaled to eta * ||w|| / ||g|| = 0.001 * 2 / 1 -> step 0.1 * 0.5 * 0.002
    torch.testing.assert_close(params[0].data, torch.full((2, 2), 1 - 0.1 * 0.5 * 0.002))
    torch.testing.assert_close(params[1].data, torch.full((2,), 1 - 0.1 * 0.5))  # 1-D: plain momentum SGD
    with pytest.raises(ValueError, match="unknown optimizer 'adam'.*adamw, sgd, lars"):
        build_optimizer("adam", groups)
