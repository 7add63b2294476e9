"""Resuming a checkpoint under another precision or another ``fused_optimizer`` (issue 50, item 1).

With ``fused_optimizer: null`` a GradScaler (``16-mixed``) builds a fused optimiser and the other precisions a
non-fused one. ``Optimizer.load_state_dict`` used to restore the checkpoint's param groups whole, ``fused``
included: a ``32-true`` checkpoint resumed under ``16-mixed`` ran torch's non-fused step while the GradScaler
(the optimiser instance still says it unscales itself) passed ``found_inf``, and the first resumed step raised
"AssertionError: Expected grad_scale and found_inf to be None". Each case fits 2 steps, then resumes to 4.
"""

from __future__ import annotations

import itertools

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
FUSED = (None, False, True)
SCALE = 2.0**4  # a small first loss scale: the tiny XCiT's float16 gradients overflow at the default 2 ** 16
BATCHES = 2  # per epoch: the first fit ends on epoch 0's last step, the resumed one runs epoch 1


class StopAfterFirstEpoch(L.Callback):  # a run killed after its epoch-0 checkpoint, schedules unchanged
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


def _trainer(tiny, root, precision: str, stop: bool = False):
    if precision == "16-mixed":  # Lightning gives CPU runs no GradScaler: the plugin with the CPU one
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler)]}
    else:
        kwargs = {"precision": precision}
    return tiny.trainer(root, max_epochs=2, callbacks=[StopAfterFirstEpoch()] if stop else [], **kwargs)


def _live_fused(precision: str, fused: bool | None) -> bool:
    """The implementation the run builds: ``fused_optimizer``, or (null) fused exactly under a GradScaler."""
    return fused if fused is not None else precision == "16-mixed"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(tiny, precision, fused)``: the checkpoint after 2 steps of a fit under ``precision`` with
    ``fused_optimizer=fused``; made once per module for each pair (several resumes read the same one)."""
    made: dict = {}

    def get(tiny, precision: str, fused: bool | None):
        key = (precision, fused)
        if key not in made:
            root = tmp_path_factory.mktemp(f"first-{precision}-{fused}")
            torch.manual_seed(0)
            model = tiny.model(fused_optimizer=fused)
            trainer = _trainer(tiny, root, precision, stop=True)
            trainer.fit(model, tiny.loader(n=4 * BATCHES))
            assert trainer.global_step == 2
            assert bool(trainer.optimizers[0].param_groups[0]["fused"]) is _live_fused(precision, fused)
            made[key] = root / "ckpt" / "last.ckpt"  # written at the end of epoch 0 (step 2)
        return made[key]

    return get


def _resume(tiny, tmp_path, checkpoint, precision: str, fused: bool | None) -> None:
    torch.manual_seed(1)
    model = tiny.model(fused_optimizer=fused)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    trainer = _trainer(tiny, tmp_path, precision)
    trainer.fit(model, tiny.loader(n=4 * BATCHES), ckpt_path=checkpoint)
    assert trainer.global_step == 4
    after = model.state_dict()
    assert all(bool(v.isfinite().all()) for v in after.values() if v.is_floating_point())
    moved = [k for k, v in saved.items() if k.startswith("student.") and not torch.equal(after[k], v)]
    assert moved, "the resumed steps left the student's weights unchanged"
    optimizer = trainer.optimizers[0]
    live = _live_fused(precision, fused)
    # The implementation is the live run's choice; the state (AdamW's step count) is the checkpoint's.
    assert [bool(g["fused"]) for g in optimizer.param_groups] == [live] * len(optimizer.param_groups)
    assert bool(optimizer.defaults["fused"]) is live
    assert max(float(s["step"]) for s in optimizer.state.values()) == 4


# In the default suite (the suite's time budget): the crash (32-true to 16-mixed under the default
# ``fused_optimizer: null``), its reverse, bf16-mixed to 16-mixed, and explicit settings that cross the fused
# choice both ways, with and without a GradScaler. The other combinations (81 in all, about 40 s): `-m slow`.
DEFAULT = {
    ("32-true", None, "16-mixed", None),
    ("16-mixed", None, "32-true", None),
    ("bf16-mixed", None, "16-mixed", None),
    ("32-true", True, "16-mixed", False),
    ("16-mixed", False, "bf16-mixed", True),
}
CASES = [
    pytest.param(*case, marks=() if case in DEFAULT else pytest.mark.slow)
    for case in itertools.product(PRECISIONS, FUSED, PRECISIONS, FUSED)
]


@pytest.mark.parametrize("before,fused_before,after,fused_after", CASES)
def test_resume_under_another_precision_or_fused_setting_keeps_the_live_optimizer(
    tiny, tmp_path, checkpoints, before, fused_before, after, fused_after
):
    _resume(tiny, tmp_path, checkpoints(tiny, before, fused_before), after, fused_after)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("saved_fused", [False, True])
def test_load_state_dict_keeps_the_live_implementation_and_the_saved_state(name, saved_fused):
    """Without Lightning: the state (moments, step counts, hyperparameters) comes from the saved optimiser, the
    implementation flags from the live one, and the caller's state dict is left as it was."""
    from ssl_xcit.dino.optim import IMPLEMENTATION_KEYS, build_optimizer

    def trained(fused: bool) -> torch.optim.Optimizer:
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(4, 3))
        optimizer = build_optimizer(name, [{"params": [param]}], fused=fused)
        optimizer.param_groups[0]["lr"] = 0.1
        for _ in range(2):
            param.grad = torch.randn_like(param)
            optimizer.step()
        return optimizer

    saved = trained(saved_fused).state_dict()
    before = repr(saved)
    live = build_optimizer(name, [{"params": [torch.nn.Parameter(torch.zeros(4, 3))]}], fused=not saved_fused)
    flags = {key: live.param_groups[0].get(key, "absent") for key in IMPLEMENTATION_KEYS}
    live.load_state_dict(saved)
    assert {key: live.param_groups[0].get(key, "absent") for key in IMPLEMENTATION_KEYS} == flags
    assert bool(live.param_groups[0]["fused"]) is not saved_fused
    assert live.param_groups[0]["lr"] == 0.1  # the rest of the group is the checkpoint's
    for key, value in saved["state"][0].items():
        torch.testing.assert_close(live.state[live.param_groups[0]["params"][0]][key], value)
    assert repr(saved) == before
