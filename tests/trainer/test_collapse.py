"""The collapse guard: each mode detected from the signals, warned once, optionally stopping the run."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from ssl_xcit.dino.collapse import CollapseGuard, collapse_mode


@pytest.mark.parametrize(
    "entropy, kl, expected",
    [
        (math.log(1024) * 0.99, 0.001, "uniform"),
        (0.05, math.log(1024) * 0.9, "one_prototype"),
        (0.05, 0.2, None),  # confident per sample and spread over the batch: healthy
        (math.log(1024) * 0.99, 1.0, None),  # near-uniform per sample but the batch mean is not uniform
        (3.0, 0.5, None),
    ],
)
def test_collapse_mode(entropy, kl, expected):
    assert collapse_mode(entropy, kl, 1024) == expected


class FakeSignals(L.Callback):
    """Forces the teacher signals of every step to a chosen collapse state (before the guard reads them)."""

    def __init__(self, signals) -> None:
        self.signals = signals

    def on_train_batch_end(self, trainer, pl_module, *args):
        pl_module.last_collapse_signals = self.signals


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_guard_warns_once_or_stops(tiny, tmp_path, action):
    L.seed_everything(0)
    model = tiny.model(
        collapse_guard=action, collapse_patience=3, collapse_grace_steps=1, sync_every_n_steps=1
    )
    uniform = (math.log(model.hparams.out_dim), 0.0)
    trainer = tiny.trainer(tmp_path, max_epochs=3, callbacks=[FakeSignals(uniform)])
    with pytest.warns(
        UserWarning, match=r"collapse \(uniform\).*entropy 4\.159.*KL to uniform 0\.0000"
    ) as rec:
        trainer.fit(model, tiny.loader())
    guard = next(cb for cb in trainer.callbacks if isinstance(cb, CollapseGuard))
    assert len([w for w in rec if "collapse" in str(w.message)]) == 1
    assert [e["mode"] for e in guard.events] == ["uniform"]
    # steps before global step 1 are in the grace period; 3 collapsed steps later it is detected at step 3
    assert guard.events[0]["step"] == 3
    assert trainer.global_step == (3 if action == "stop" else 12)


def test_guard_stays_silent_on_a_real_short_run(tiny, tmp_path, recwarn):
    L.seed_everything(0)
    model = tiny.model(collapse_patience=2, collapse_grace_steps=0)
    trainer = tiny.trainer(tmp_path, max_epochs=1)
    trainer.fit(model, tiny.loader())
    guard = next(cb for cb in trainer.callbacks if isinstance(cb, CollapseGuard))
    entropy, kl = model.last_collapse_signals
    assert guard.events == [] or guard.events[0]["mode"] == collapse_mode(entropy, kl, 64)


def test_guard_reads_the_device_every_k_steps_and_names_the_step_it_collapsed(tiny, tmp_path, monkeypatch):
    """Signals stay on the device between reads: with sync_every_n_steps=5 the host reads them once per 5
    batches (plus at the epoch's end), detects the collapse at step 3 as with k=1, and stops at the read."""
    from ssl_xcit.dino import collapse

    reads = []
    gather = collapse._gather_rows
    monkeypatch.setattr(collapse, "_gather_rows", lambda t, rows: reads.append(len(rows)) or gather(t, rows))
    L.seed_everything(0)
    model = tiny.model(
        collapse_guard="stop", collapse_patience=3, collapse_grace_steps=1, sync_every_n_steps=5
    )
    uniform = (torch.tensor(math.log(model.hparams.out_dim)), torch.tensor(0.0))
    trainer = tiny.trainer(tmp_path, max_epochs=3, callbacks=[FakeSignals(uniform)])
    with pytest.warns(UserWarning, match=r"collapse \(uniform\) for 3 steps at step 3"):
        trainer.fit(model, tiny.loader())
    guard = next(cb for cb in trainer.callbacks if isinstance(cb, CollapseGuard))
    assert [(e["mode"], e["step"]) for e in guard.events] == [("uniform", 3)]
    # 4 batches per epoch (global steps 1-4 after each; grace 1): all 4 are buffered and read once, at the
    # epoch's end; the run stops there, at step 4, where a read per step stopped at step 3.
    assert reads == [4] and trainer.global_step == 4
