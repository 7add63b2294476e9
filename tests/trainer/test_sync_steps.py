"""``sync_every_n_steps`` counts optimiser steps: with accumulation, the finite-loss read and the collapse guard's
read come at every N-th window's end, not every N micro-batches."""

from __future__ import annotations

from ssl_xcit.dino.collapse import CollapseGuard
from ssl_xcit.dino.lifecycle import DINOLifecycle


def test_reads_come_every_n_optimiser_steps_under_accumulation(tiny, tmp_path, monkeypatch):
    finite_reads, guard_reads = [], []
    read_finite, guard_read = DINOLifecycle._read_finite, CollapseGuard._read

    def recording_finite(module):
        if module._finite.pending:  # a read with something to read (the epoch's end reads nothing new)
            finite_reads.append(module.global_step)
        return read_finite(module)

    def recording_guard(guard, trainer, pl_module, terms):
        guard_reads.append([step for step, _ in guard._pending])
        return guard_read(guard, trainer, pl_module, terms)

    monkeypatch.setattr(DINOLifecycle, "_read_finite", recording_finite)
    monkeypatch.setattr(CollapseGuard, "_read", recording_guard)
    model = tiny.model(accumulate_grad_batches=2, sync_every_n_steps=2, collapse_grace_steps=0)
    trainer = tiny.trainer(tmp_path, max_epochs=1)
    trainer.fit(model, tiny.loader(n=32, batch_size=4))  # 8 micro-batches: 4 optimiser steps
    assert trainer.global_step == 4
    assert finite_reads == [2, 4]  # after steps 2 and 4 (micro-batches 4 and 8); was every 2 micro-batches
    assert guard_reads == [[1, 2], [3, 4]]  # one entry per optimiser step, read with the finite check
