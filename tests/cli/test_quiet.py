"""Quiet output: the noise is gone, the true messages stay."""

from __future__ import annotations

import logging
import types
import warnings

import torch
from lightning.pytorch.utilities import rank_zero_info

from ssl_xcit.cli import quiet
from ssl_xcit.cli.train import main, metrics_table
from ssl_xcit.trainer.callbacks import OnlineKNN

from .conftest import tiny_config


def test_tips_and_leafspec_are_dropped_other_messages_kept(caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        quiet.install_filters()
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing litlogger")
        rank_zero_info("DINO data: 16 training images")
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("a true warning about the run", UserWarning, stacklevel=1)
    assert "Tip" not in caplog.text and "DINO data: 16 training images" in caplog.text
    assert [str(w.message) for w in caught] == ["a true warning about the run"]


def test_num_workers_capped_to_cores_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(quiet, "available_cores", lambda: 2)
    with caplog.at_level(logging.INFO):
        assert quiet.cap_workers(8) == 2 and quiet.cap_workers(1) == 1
    assert caplog.text.count("8 workers requested, 2 CPU cores available; using 2") == 1


def test_model_summary_has_no_flops(caplog):
    data = [(" ", ["0"]), ("Name", ["student"]), ("Type", ["MultiCropWrapper"]), ("Params", ["6.0 M"]),
            ("Mode", ["train"]), ("FLOPs", ["0"])]  # fmt: skip
    with caplog.at_level(logging.INFO):
        quiet.CompactModelSummary.summarize(data, 12_000_000, 6_000_000, 47.7, {"train": 199, "eval": 0}, 0)
    assert "student" in caplog.text and "6.0 M" in caplog.text and "Trainable params" in caplog.text
    assert "FLOPs" not in caplog.text and "Flops" not in caplog.text


def test_metrics_table_rounds_float32():
    table = metrics_table(
        {"knn/temperature": torch.tensor(0.07), "val/loss": torch.tensor(5.8031234)}, "validate"
    )
    assert table.splitlines() == ["validate", "knn/temperature  0.07", "val/loss         5.803"]


def test_knn_disabled_said_once_when_the_datamodule_already_said_it():
    datamodule = types.SimpleNamespace(knn_datasets=lambda: None, knn_unavailable_reason="data is unlabelled")
    trainer = types.SimpleNamespace(
        datamodule=datamodule, is_global_zero=True, current_epoch=0, global_step=0
    )
    module = types.SimpleNamespace(teacher=None, device=torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second notice would raise here
        assert OnlineKNN().evaluate(trainer, module) is None


def test_fit_output_is_quiet(tmp_path, image_folder, caplog, capsys):
    with caplog.at_level(logging.INFO):
        main(["fit", *tiny_config(tmp_path, image_folder), "--trainer.enable_model_summary=true"])
    text = caplog.text + "".join(str(r) for r in capsys.readouterr())
    for noise in ("Tip", "litlogger", "litmodels", "LeafSpec", "FLOPs", "Flops", "1 epochs"):
        assert noise not in text, noise
    assert "DINO schedules: 1 epoch x 4 steps" in text
    assert "Trainable params" in text  # the summary itself is still there
    # where things are, at the end of fit
    run = tmp_path / "runs" / "version_0"
    assert f"run folder: {run}" in text and f"last checkpoint: {run / 'checkpoints' / 'last.ckpt'}" in text
    assert "kept checkpoints: epoch=0000.ckpt" in text and "final online k-NN top-1: " in text
    assert f"next: ssl-xcit export {run / 'checkpoints' / 'last.ckpt'} {run / 'teacher.safetensors'}" in text


def test_torchdatas_set_vital_notice_is_dropped():
    """torchdata's StatefulDataLoader (the training loader) warns about a deprecated torch call it makes."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ssl_xcit.cli.quiet import install_filters

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install_filters()
        StatefulDataLoader([1, 2])
    assert not [w for w in caught if "set_vital" in str(w.message)]
