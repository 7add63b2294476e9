"""``build_optimizer(..., fused=True)``: torch's fused AdamW/SGD give the unfused update; unsupported cases are
one-line errors at build time."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.optim import build_optimizer, get_params_groups
from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {"backbone": create_model("xcit_nano_12_p16", depth=1), "head": DINOHead(128, 32, hidden_dim=32)}
    )


def _train(model: nn.Module, name: str, fused: bool, steps: int = 3) -> torch.optim.Optimizer:
    opt = build_optimizer(name, get_params_groups(model), fused=fused)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        for i, group in enumerate(opt.param_groups):  # as DINO sets the schedules before each step
            group["lr"] = 1e-3 * (step + 1)
            if i == 0:
                group["weight_decay"] = 0.04 + 0.1 * step
        model.zero_grad(set_to_none=True)
        model["head"](model["backbone"](x)).square().mean().backward()
        opt.step()
    return opt


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_step_equals_the_unfused_step(name):
    plain, fused = _model(), _model()
    fused.load_state_dict(plain.state_dict())
    start = copy.deepcopy(plain.state_dict())
    opt_plain = _train(plain, name, fused=False)
    opt_fused = _train(fused, name, fused=True)
    assert opt_fused.param_groups[0]["fused"] is True and not opt_plain.param_groups[0]["fused"]
    assert type(opt_fused) is type(opt_plain)
    assert [len(g["params"]) for g in opt_fused.param_groups] == [
        len(g["params"]) for g in opt_plain.param_groups
    ]
    deltas = {k: (plain.state_dict()[k] - v, fused.state_dict()[k] - v) for k, v in start.items()}
    scale = max(float(d.abs().max()) for d, _ in deltas.values())
    assert scale > 1e-4  # the steps moved the weights, so the comparison below means something
    # The updates agree to 0.1 % of the largest one: the fused kernel rounds differently where a gradient is
    # near AdamW's eps, but a missing term (weight decay, a bias correction) would be far larger.
    for key, (d_plain, d_fused) in deltas.items():
        torch.testing.assert_close(d_fused, d_plain, rtol=1e-3, atol=1e-3 * scale, msg=key)


def test_fused_lars_is_refused_naming_the_optimizer():
    with pytest.raises(UserError, match=r"optimizer 'lars' has no fused implementation.*adamw, sgd"):
        build_optimizer("lars", get_params_groups(_model()), fused=True)


def test_fused_on_a_device_without_fused_kernels_is_refused_at_build_time():
    param = nn.Parameter(torch.zeros(2, 2, device="meta"))
    with pytest.raises(UserError, match=r"no fused adamw for parameters on device 'meta'.*supports: .*cuda"):
        build_optimizer("adamw", [{"params": [param]}], fused=True)


def test_unknown_optimizer_is_still_an_error_with_fused():
    with pytest.raises(UserError, match=r"unknown optimizer 'adam'; valid: adamw, sgd, lars"):
        build_optimizer("adam", get_params_groups(_model()), fused=True)


def test_default_is_torch_default_implementation():
    opt = build_optimizer("adamw", get_params_groups(_model()))
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None


def test_dino_fused_optimizer_setting_builds_the_fused_kernel():
    """``fused_optimizer: true`` (a recipe value) reaches the optimiser the module builds for training."""
    from ssl_xcit.dino.module import DINO

    kw = dict(backbone="xcit_nano_12_p16", backbone_kwargs={"depth": 1}, out_dim=32, head_hidden_dim=16,
              head_bottleneck_dim=8)  # fmt: skip
    assert DINO(fused_optimizer=True, **kw).configure_optimizers().defaults["fused"] is True
    assert not DINO(**kw).configure_optimizers().defaults.get("fused")
