"""Under gradient accumulation the centres move once per optimiser step, as one step over the window's
concatenated batch would move them (the schedules, the optimiser and the EMA do the same)."""

from __future__ import annotations

import lightning as L
import torch


class CentreWatch(L.Callback):
    """The DINO centre after every micro-batch, and the teacher's outputs on each micro-batch."""

    def __init__(self) -> None:
        self.centres, self.teacher_rows = [], []

    def on_train_start(self, trainer, pl_module):
        self.centres.append(pl_module.dino_loss.center.detach().clone())
        pl_module.teacher.register_forward_hook(
            lambda module, args, out: self.teacher_rows.append(out.detach().clone())
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.centres.append(pl_module.dino_loss.center.detach().clone())


def test_centre_moves_once_per_accumulation_window(tiny, tmp_path):
    watch = CentreWatch()
    model = tiny.model(accumulate_grad_batches=2, center_momentum=0.8, collapse_guard="off")
    trainer = tiny.trainer(tmp_path, max_epochs=1, callbacks=[watch], limit_train_batches=4)
    trainer.fit(model, tiny.loader(n=16, batch_size=4))
    assert trainer.global_step == 2 and len(watch.teacher_rows) == 4
    c = watch.centres
    for window in range(2):
        start, middle, end = c[2 * window], c[2 * window + 1], c[2 * window + 2]
        assert torch.equal(middle, start)  # the first micro-batch leaves it where it was
        rows = torch.cat(watch.teacher_rows[2 * window : 2 * window + 2]).double()
        expected = 0.8 * start.double() + 0.2 * rows.mean(0, keepdim=True)
        torch.testing.assert_close(end.double(), expected, rtol=1e-6, atol=1e-7)
