"""Checkpoints, exported backbones and feature caches follow the umask like any other file (a group that shares
a cluster can read them); ``SSL_XCIT_PRIVATE=1`` makes them owner-only (0600 files in 0700 folders)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

# With umask 027 the group may read (0640 files, 0750 folders) and others get nothing.
UMASK = 0o027
SHARED = (0o640, 0o750)
PRIVATE = (0o600, 0o700)


@pytest.fixture(params=[False, True], ids=["umask", "SSL_XCIT_PRIVATE=1"])
def private(request, monkeypatch):
    if request.param:
        monkeypatch.setenv("SSL_XCIT_PRIVATE", "1")
    else:
        monkeypatch.delenv("SSL_XCIT_PRIVATE", raising=False)
    old = os.umask(UMASK)
    yield request.param
    os.umask(old)


def _modes(path) -> tuple[int, int]:
    return stat.S_IMODE(path.stat().st_mode), stat.S_IMODE(path.parent.stat().st_mode)


def test_checkpoints(private, tmp_path):
    from ssl_xcit.trainer.checkpointing import AtomicCheckpointIO

    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"epoch": 0, "w": torch.ones(2)}, path)
    assert _modes(path) == (PRIVATE if private else SHARED)


def test_exported_backbones(private, tmp_path):
    from ssl_xcit.cli.export import export_teacher
    from ssl_xcit.models import create_model

    state = create_model("xcit_nano_12_p8", depth=1).state_dict()
    ckpt = tmp_path / "last.ckpt"
    torch.save(
        {
            "state_dict": {f"teacher.backbone.{k}": v for k, v in state.items()},
            "hyper_parameters": {"backbone": "xcit_nano_12_p8", "backbone_kwargs": {"depth": 1}},
        },
        ckpt,
    )
    out, _ = export_teacher(ckpt, tmp_path / "exports" / "teacher.pth")
    assert _modes(out) == (PRIVATE if private else SHARED)


def test_feature_caches(private, tmp_path):
    from ssl_xcit.evaluation.cache import save_cached

    path = save_cached(tmp_path / "features", "train", {"k": 1}, {"x": torch.zeros(2)})
    assert _modes(path) == (PRIVATE if private else SHARED)


def test_other_umasks_are_honoured_too(tmp_path, monkeypatch):
    from ssl_xcit.evaluation.cache import save_cached

    monkeypatch.delenv("SSL_XCIT_PRIVATE", raising=False)
    old = os.umask(0o002)  # a group-writable setup
    try:
        path = save_cached(tmp_path / "features", "train", {"k": 1}, {"x": torch.zeros(2)})
    finally:
        os.umask(old)
    assert _modes(path) == (0o664, 0o775)
