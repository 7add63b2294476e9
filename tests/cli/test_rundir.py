"""One folder per run: two runs never share checkpoints, and ``--ckpt_path last`` resumes the newest one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from ssl_xcit.cli.rundir import latest_resumable, new_run_dir
from ssl_xcit.cli.train import main

from .conftest import tiny_config


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_versions_are_numbered_and_latest_resumable_skips_runs_without_last(tmp_path):
    root = tmp_path / "runs"
    assert [new_run_dir(root).name for _ in range(3)] == ["version_0", "version_1", "version_2"]
    (root / "version_10").mkdir()
    assert new_run_dir(root).name == "version_11"
    assert latest_resumable(root) is None
    (root / "version_1" / "checkpoints").mkdir()
    (root / "version_1" / "checkpoints" / "last.ckpt").write_bytes(b"x")
    assert latest_resumable(root) == root / "version_1"  # version_11 has no last.ckpt


@pytest.mark.slow  # ~10 s: three fits (the default suite's budget); latest_resumable's choice is tested above
def test_two_runs_then_resume_picks_the_latest(tmp_path, image_folder, caplog):
    args = tiny_config(tmp_path, image_folder)
    runs = tmp_path / "runs"
    main(["fit", *args])
    main(["fit", *args])
    first, second = runs / "version_0", runs / "version_1"
    for run in (first, second):  # logs and checkpoints together, one folder each
        assert (run / "checkpoints" / "last.ckpt").is_file()
        assert (run / "csv" / "version_0" / "metrics.csv").is_file()
    first_bytes = (first / "checkpoints" / "last.ckpt").read_bytes()
    caplog.clear()

    with caplog.at_level("INFO"):
        cli = main(["fit", *args, "--ckpt_path=last", "--trainer.max_epochs=2"])
    assert f"resuming {second} from {second / 'checkpoints' / 'last.ckpt'}" in caplog.text
    assert "exists and is not empty" not in caplog.text  # resuming a run into its own folder is expected
    assert cli.trainer.global_step == 8  # 4 steps restored + 4 new: it continued, not restarted
    resumed = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["epoch"] == 1 and resumed["global_step"] == 8
    assert (first / "checkpoints" / "last.ckpt").read_bytes() == first_bytes  # the other run untouched
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]  # no new folder
    # a resumed run keeps the first session's metrics and logs the second beside them
    assert (second / "csv" / "version_1" / "metrics.csv").is_file()

    cli = main(["validate", *args, "--ckpt_path=last"])
    assert cli.trainer.ckpt_path == str(second / "checkpoints" / "last.ckpt")
    assert (second / "validate" / "csv" / "version_0" / "metrics.csv").is_file()


def test_default_root_dir_and_run_dir_move_everything(tmp_path, image_folder):
    args = tiny_config(tmp_path, image_folder)
    elsewhere = tmp_path / "elsewhere"
    main(["fit", *args, f"--trainer.default_root_dir={elsewhere}"])
    assert (elsewhere / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert (elsewhere / "version_0" / "csv" / "version_0" / "metrics.csv").is_file()
    named = tmp_path / "my_run"
    main(["fit", *args, f"--run_dir={named}"])
    assert (named / "checkpoints" / "last.ckpt").is_file() and (named / "csv").is_dir()
    assert not (tmp_path / "runs").exists()  # nothing landed in the recipe's root


@pytest.mark.parametrize("private", [False, True], ids=["umask", "SSL_XCIT_PRIVATE=1"])
def test_checkpoint_modes_follow_the_umask_or_ssl_xcit_private(private, tmp_path, image_folder, monkeypatch):
    import os

    if private:
        monkeypatch.setenv("SSL_XCIT_PRIVATE", "1")
    old = os.umask(0o027)
    try:
        main(["fit", *tiny_config(tmp_path, image_folder), "--trainer.max_epochs=1"])
    finally:
        os.umask(old)
    folder = tmp_path / "runs" / "version_0" / "checkpoints"
    assert _mode(folder) == (0o700 if private else 0o750)
    assert {_mode(p) for p in folder.glob("*.ckpt")} == {0o600 if private else 0o640}


def test_validate_last_without_any_run_is_an_error(tmp_path, image_folder):
    with pytest.raises(
        FileNotFoundError, match=r"--ckpt_path last: no run under .*runs has checkpoints/last.ckpt"
    ):
        main(["validate", *tiny_config(tmp_path, image_folder), "--ckpt_path=last"])


@pytest.mark.parametrize(
    "flag", ["--trainer.default_root_dir=memory://bucket/runs", "--run_dir=s3://bucket/run"]
)
def test_a_remote_run_folder_is_refused_not_written_locally(flag, tmp_path, image_folder, monkeypatch):
    from ssl_xcit.errors import UserError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"is a remote URL, but the command line numbers and resumes runs"):
        main(["fit", *tiny_config(tmp_path, image_folder), flag])
    assert not list(tmp_path.glob("*:"))  # no local "memory:" or "s3:" folder
