import torch
from torch import nn

from ssl_xcit.utils.modes import eval_mode


def test_eval_mode_restores_each_submodule_mode():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.BatchNorm1d(2), nn.Dropout(0.5)))
    model.train()
    model[1][0].eval()  # a mixed state, as a frozen part inside a training model
    before = [m.training for m in model.modules()]
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == before


def test_eval_mode_restores_on_error():
    model = nn.Sequential(nn.Dropout(0.5)).train()
    try:
        with eval_mode(model):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert all(m.training for m in model.modules())


def _trained_module() -> nn.Sequential:
    """Linear + BatchNorm + Linear with a tied weight, gradients and moved running statistics, in a mixed mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    model(torch.randn(8, 4)).square().sum().backward()
    model[1].eval()
    return model


def test_eval_mode_on_a_device_hands_back_the_callers_tensors():
    """Evaluated on another device (meta here; a GPU teacher evaluated on the CPU in use), the module comes back
    on its own device, with the very tensors, gradients and Parameter objects it had, and keeps training."""
    model = _trained_module()
    params = list(model.parameters())
    optimiser = torch.optim.SGD(params, lr=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in params]
    modes = [m.training for m in model.modules()]
    with eval_mode(model, "meta"):
        assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
        assert {p.grad.device.type for p in model.parameters()} == {"meta"}
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == modes
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert model[2].weight is model[0].weight
    for key, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, state[key]), key
    for p, grad in zip(params, grads, strict=True):
        assert torch.equal(p.grad, grad)
    optimiser.step()  # the optimiser's parameters are the module's again, on their device
    assert not torch.equal(model[0].weight, state["0.weight"])


def test_eval_mode_on_a_device_hands_back_on_error():
    model = _trained_module()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with eval_mode(model, "meta"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    for key, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, state[key]), key
    assert model[0].training and not model[1].training
