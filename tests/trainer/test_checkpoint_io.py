"""AtomicCheckpointIO: local checkpoints are written atomically, remote (fsspec) ones through Lightning's IO.

fsspec's in-memory filesystem (``memory://``) stands in for S3 and the other object stores: same code path
(any protocol but ``file``), no network.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from fsspec import filesystem, register_implementation
from fsspec.implementations.memory import MemoryFileSystem

from ssl_xcit.errors import UserError
from ssl_xcit.trainer.checkpointing import AtomicCheckpointIO


class RecordingMemoryFS(MemoryFileSystem):
    """An in-memory filesystem of its own that records the options each instance was created with."""

    protocol = "recordingmem"
    store: dict = {}
    pseudo_dirs = [""]
    created_with: list[dict] = []

    def __init__(self, *args, **storage_options):
        type(self).created_with.append(dict(storage_options))
        super().__init__(*args, **storage_options)


register_implementation("recordingmem", RecordingMemoryFS, clobber=True)


@pytest.fixture
def memory_fs():
    fs = filesystem("memory")
    yield fs
    if fs.exists("/ssl_xcit_test"):
        fs.rm("/ssl_xcit_test", recursive=True)


def test_remote_checkpoint_saves_loads_and_removes_through_fsspec(memory_fs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a remote path taken as a local one would land here as ./memory:/...
    io = AtomicCheckpointIO()
    url = "memory://ssl_xcit_test/run/checkpoints/last.ckpt"
    io.save_checkpoint({"epoch": 3, "w": torch.arange(4.0)}, url)
    assert memory_fs.isfile("/ssl_xcit_test/run/checkpoints/last.ckpt")
    loaded = io.load_checkpoint(url)
    assert loaded["epoch"] == 3 and torch.equal(loaded["w"], torch.arange(4.0))
    io.remove_checkpoint(url)
    assert not memory_fs.exists("/ssl_xcit_test/run/checkpoints/last.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_storage_options_reach_the_remote_filesystem():
    RecordingMemoryFS.created_with.clear()
    io = AtomicCheckpointIO()
    url = "recordingmem://bucket/run/epoch=0001.ckpt"
    io.save_checkpoint({"epoch": 1}, url, storage_options={"endpoint_marker": "eu-west"})
    assert {"endpoint_marker": "eu-west"} in RecordingMemoryFS.created_with
    assert filesystem("recordingmem").isfile(url)
    assert io.load_checkpoint(url)["epoch"] == 1
    with pytest.raises(UserError, match="storage_options must be a dict of fsspec filesystem options"):
        io.save_checkpoint({"epoch": 1}, url, storage_options=["eu-west"])


def test_local_paths_stay_atomic_and_refuse_storage_options(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"epoch": 2}, f"file://{tmp_path}/sub/last.ckpt")  # a file:// URL is a local path
    assert torch.load(tmp_path / "sub" / "last.ckpt", weights_only=True) == {"epoch": 2}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["last.ckpt"]
    with pytest.raises(UserError, match=r"local path; got \{'anon': True\}"):
        io.save_checkpoint({"epoch": 2}, tmp_path / "last.ckpt", storage_options={"anon": True})


def test_a_fit_with_a_remote_default_root_dir_keeps_its_checkpoints_there(
    tiny, memory_fs, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    L.seed_everything(0)
    model = tiny.model()
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir="memory://ssl_xcit_test/runs",
    )
    trainer.fit(model, tiny.loader(n=8))
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    saved = memory_fs.glob("/ssl_xcit_test/runs/checkpoints/*.ckpt")
    assert saved, memory_fs.find("/ssl_xcit_test")
    checkpoint = trainer.strategy.checkpoint_io.load_checkpoint(f"memory://{saved[0]}")
    assert checkpoint["epoch"] == 0 and any(
        k.startswith("teacher.backbone.") for k in checkpoint["state_dict"]
    )
    assert list(tmp_path.iterdir()) == []  # nothing written to a local "memory:" folder
