"""Lightning's per-step SIGTERM broadcast is off while PreemptionCheckpoint owns SIGTERM, and comes back after."""

from __future__ import annotations

import lightning as L

from ssl_xcit.trainer import sigterm_broadcast


def test_silence_replaces_the_loops_broadcast_and_restore_undoes_it():
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    loop = trainer.fit_loop.epoch_loop
    assert "_broadcast_sigterm_tensor" not in vars(loop)  # Lightning 2.6: the class's method, run every step
    assert sigterm_broadcast.silence(trainer)
    loop._broadcast_sigterm_tensor()  # a no-op: no tensor, no collective (none is initialised here)
    assert vars(loop)["_broadcast_sigterm_tensor"] is sigterm_broadcast._skip_broadcast
    sigterm_broadcast.restore(trainer)
    assert "_broadcast_sigterm_tensor" not in vars(loop)
    assert type(loop)._broadcast_sigterm_tensor is not sigterm_broadcast._skip_broadcast  # class untouched


def test_upstream_setting_is_used_where_lightning_has_it():
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.broadcast_sigterm_every_n_steps = 1  # the setting Lightning's PR 21640 proposes
    assert sigterm_broadcast.silence(trainer)
    assert trainer.broadcast_sigterm_every_n_steps > 10**9
    # The setting, not the override.
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)
    sigterm_broadcast.restore(trainer)
    assert trainer.broadcast_sigterm_every_n_steps == 1


def test_preemption_callback_silences_only_while_it_owns_sigterm(tmp_path):
    import signal

    from ssl_xcit.trainer.preemption import PreemptionCheckpoint

    seen = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["during"] = "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop)
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    from conftest import tiny_loader, tiny_model

    callback = PreemptionCheckpoint(requeue=False)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[callback, Probe()], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(tiny_model(), tiny_loader(n=4))
    assert seen == {"during": True, "handler": callback._on_signal}
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)  # restored at teardown
