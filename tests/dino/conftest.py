"""Tiny DINO models and in-memory multi-crop data, so Lightning runs take seconds on 2 CPU cores."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.dino.module import DINO

TINY = dict(
    backbone="xcit_nano_12_p8",
    backbone_kwargs={"depth": 1},
    drop_path_rate=0.1,
    out_dim=64,
    head_hidden_dim=32,
    head_bottleneck_dim=16,
    warmup_epochs=1,
    lr=0.02,
    min_lr=1e-4,
    freeze_last_layer=1,
)


class RandomCrops(Dataset):
    """``n`` items of 2 global (16 px) + 2 local (8 px) crops. The crops draw from the global torch RNG like a
    random augmentation would, so a resumed run only matches if RNG states are restored. ``gram_scale``: with
    the Gram teacher's crops, ``{"crops": ..., "gram_crops": ...}`` as the datamodule gives a model that anchors
    (each global crop repeated to ``gram_scale`` x its side: no further draw)."""

    def __init__(self, n: int = 16, noise: bool = True, gram_scale: int = 0) -> None:
        self.n, self.noise, self.gram_scale = n, noise, gram_scale

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        label = i % 4
        base = torch.full((3, 16, 16), float(label) - 1.5)
        base[label % 3] += 1.0
        crops = []
        for size in (16, 16, 8, 8):
            x = base[:, :size, :size].clone()
            if self.noise:
                x = x + 0.5 * torch.randn_like(x)
            crops.append(x)
        if self.gram_scale:
            s = self.gram_scale
            gram = [c.repeat_interleave(s, -1).repeat_interleave(s, -2) for c in crops[:2]]
            return {"crops": crops, "gram_crops": gram}, label, i
        return crops, label, i


class Recorder(L.Callback):
    """Per-step loss; the last-layer weights at each epoch's start and end."""

    def __init__(self, stop_after_epoch: int | None = None) -> None:
        self.losses, self.last_layer = [], {}
        self.stop_after_epoch = stop_after_epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_epoch_start(self, trainer, pl_module):
        self.last_layer[("start", trainer.current_epoch)] = (
            pl_module.student.head.last_layer.weight_v.detach().clone()
        )

    def on_train_epoch_end(self, trainer, pl_module):
        self.last_layer[("end", trainer.current_epoch)] = (
            pl_module.student.head.last_layer.weight_v.detach().clone()
        )
        if self.stop_after_epoch is not None and trainer.current_epoch == self.stop_after_epoch:
            trainer.should_stop = True


def tiny_model(**overrides) -> DINO:
    return DINO(**{**TINY, **overrides})


def tiny_trainer(tmp_path, max_epochs: int = 2, callbacks=(), **kwargs) -> L.Trainer:
    from ssl_xcit.trainer.checkpointing import dino_checkpoints

    return L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, *dino_checkpoints(dirpath=tmp_path / "ckpt", every_n_epochs=1)],
        default_root_dir=tmp_path,
        **kwargs,
    )


def tiny_loader(
    n: int = 16, batch_size: int = 4, shuffle: bool = True, noise: bool = True, gram_scale: int = 0
) -> DataLoader:
    return DataLoader(
        RandomCrops(n, noise, gram_scale), batch_size=batch_size, shuffle=shuffle, drop_last=True
    )


@pytest.fixture
def tiny():
    """Factories: ``tiny.model(**overrides)``, ``tiny.trainer(tmp_path, ...)``, ``tiny.loader(...)``; the
    ``tiny.Recorder`` callback (per-step losses, last-layer weights per epoch)."""

    class _Tiny:
        Recorder = Recorder
        model = staticmethod(tiny_model)
        trainer = staticmethod(tiny_trainer)
        loader = staticmethod(tiny_loader)

    return _Tiny


@pytest.fixture
def knn_top1():
    """``knn_top1(backbone, bank_dataset, query_dataset)``: DINO's weighted k-NN top-1 (k 20, T 0.07) in %."""
    from ssl_xcit.evaluation.embed import embed_dataset
    from ssl_xcit.evaluation.knn import knn_accuracy

    def top1(backbone: torch.nn.Module, bank_ds, query_ds) -> float:
        bank, query = embed_dataset(backbone, bank_ds), embed_dataset(backbone, query_ds)
        scores = knn_accuracy(bank["features"], bank["labels"], query["features"], query["labels"], ks=(20,))
        return scores[20]["top1"]

    return top1


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc). torchrun starts each worker in a session of its own, so
    killing the launcher's process group would leave the workers running."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def torchrun(worker, *args: str, timeout: int = 120, nproc: int = 2) -> None:
    """Run ``worker`` (a script path) as ``nproc`` gloo processes under ``torch.distributed.run``. A rank waiting in
    a collective the other never enters ends in ``subprocess.TimeoutExpired`` after ``timeout`` seconds, with
    the launcher and both workers killed, never in a hung suite."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
        f"--master_port={port}", str(worker), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=30)
        raise
    assert proc.returncode == 0, stderr[-3000:]


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory):
    """The 2-process runs of ``ddp_worker.py`` that ``test_ddp.py`` and ``test_fsdp2_checkpoints.py`` read, one
    after another in one launch (each in its own folder): starting torchrun and importing torch and Lightning
    in both ranks took most of each test's ~17 s. A rank left waiting in a collective ends in
    ``TimeoutExpired``, with the launcher and both workers killed. FSDP2's runs (``ssl_xcit.parallel.fsdp``) share
    the launch; the DDP runs are their reference, and ``fsdp2-plain/last.ckpt`` is a sharded checkpoint."""
    from pathlib import Path

    out = tmp_path_factory.mktemp("ddp")
    modes = "plain,empty,ibot,distill,init_from,rankme,high_res,fsdp2:plain,fsdp2:distill,fsdp2:init_from"
    torchrun(Path(__file__).with_name("ddp_worker.py"), str(out), "2", modes, timeout=300)
    return out
