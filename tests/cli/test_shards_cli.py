"""`ssl-xcit fit` and `validate` reading prepared shards (``--data.root DIR``), for each ``augment_on``."""

from __future__ import annotations

import pytest
import torch

from ssl_xcit.cli import main as ssl_xcit
from ssl_xcit.cli.train import main
from ssl_xcit.data.streaming import ShardLoader

from .conftest import tiny_config


@pytest.mark.parametrize("augment_on", ["cpu", "device"])
def test_prepare_then_fit_then_validate_on_shards(tmp_path, image_folder, augment_on):
    train, val = tmp_path / "train", tmp_path / "val"
    for split, out in (("train", train), ("val", val)):
        ssl_xcit(["prepare", str(image_folder / split), str(out), "--chunk-bytes", "2kB", "--no-progress"])
    args = [
        *tiny_config(tmp_path, image_folder),
        f"--data.init_args.root={train}",
        f"--data.init_args.val_root={val}",
        f"--data.init_args.augment_on={augment_on}",
    ]
    fit = main(["fit", *args])
    assert isinstance(fit.trainer.train_dataloader, ShardLoader)
    assert fit.trainer.global_step == 4  # 16 records / batch 4, 1 epoch
    assert fit.datamodule.train_dataset.num_records == 16 and fit.datamodule.train_dataset.classes == [
        "class0",
        "class1",
    ]
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state["num_samples_yielded"] == 16 and state["dataset"]["shuffle"]
    knn = next(cb for cb in fit.trainer.callbacks if type(cb).__name__ == "OnlineKNN")
    assert [h["step"] for h in knn.history] == [0, 4]  # the bank read from the training shards

    cli = main(["validate", *args, f"--ckpt_path={last}"])
    assert "knn/top1" in cli.trainer.callback_metrics and "val/loss" in cli.trainer.callback_metrics
    assert cli.trainer.callback_metrics["knn/top1"] == pytest.approx(knn.history[-1]["top1"])
