"""``ssl-xcit validate`` scores a checkpoint at the epoch and step it was saved at, as ``fit`` did."""

from __future__ import annotations

import torch

from ssl_xcit.cli.train import main
from ssl_xcit.dino.loss import DINOLoss

from .conftest import tiny_config


def test_validate_uses_the_checkpoints_epoch_and_step(tmp_path, image_folder, monkeypatch):
    # Teacher temperature 0.02 at epoch 0 -> 0.07 at epoch 1: a validate that thinks it is at epoch 0 differs.
    args = [
        *tiny_config(tmp_path, image_folder),
        "--trainer.max_epochs=2",
        "--model.init_args.warmup_teacher_temp=0.02",
        "--model.init_args.teacher_temp=0.07",
        "--model.init_args.warmup_teacher_temp_epochs=1",
    ]
    epochs_seen: list[int] = []
    forward = DINOLoss.forward

    def spy(self, student, teacher, epoch, *rest, **kwargs):
        epochs_seen.append(epoch)
        return forward(self, student, teacher, epoch, *rest, **kwargs)

    monkeypatch.setattr(DINOLoss, "forward", spy)
    fit = main(["fit", *args])
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (1, 8)
    fit_val_epoch = epochs_seen[-1]  # the last validation batch of fit
    assert fit_val_epoch == 1

    epochs_seen.clear()
    cli = main(["validate", *args, f"--ckpt_path={last}"])
    assert epochs_seen and set(epochs_seen) == {fit_val_epoch}
    assert cli.model.dino_loss.teacher_temp_at(cli.model.trained_epoch) == 0.07
    knn = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "OnlineKNN")
    assert (knn.history[-1]["epoch"], knn.history[-1]["step"]) == (1, 8)  # not "epoch 0 step 0"
    fit_knn = next(cb for cb in fit.trainer.callbacks if type(cb).__name__ == "OnlineKNN")
    # same weights, same eval transform (no randomness): the same k-NN top-1 as at the end of fit
    assert knn.history[-1]["top1"] == fit_knn.history[-1]["top1"]
