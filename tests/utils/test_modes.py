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
