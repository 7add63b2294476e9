"""One ``fsdp2_whole`` checkpoint written and read on 2 gloo processes, with each rank's memory high-water mark:
``python fsdp2_whole_stream_worker.py OUT_DIR BACKBONE [DEPTH]``.

One AdamW step of a DINO model (so every parameter has optimiser state), then ``trainer.save_checkpoint``; each
rank's resident-memory high-water mark (``VmHWM``, reset just before through ``/proc/self/clear_refs``) is taken
over the save, and over a resume from the file in a fresh fit. For the comparison, the whole state as
Lightning's ``ModelParallelStrategy`` gathers it (its ``lightning_module_state_dict`` and ``optimizer_state``,
on rank 0) is written next to it. Each rank writes OUT_DIR/rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parents[1] / "dino"))
from fsdp2_worker import GLOBAL_BATCH, HEAD, Crops  # noqa: E402


def high_water_kib() -> int:
    """This process's resident-memory high-water mark (VmHWM), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def resident_kib(kind: str = "VmRSS") -> int:
    """This process's resident memory now, KiB: all of it (``VmRSS``), or file pages mapped (``RssFile``: of a
    memory-mapped checkpoint, the pages read) or anonymous memory (``RssAnon``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {kind} in /proc/self/status")


def reset_high_water() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the high-water mark starts again from VmRSS


class GatherCounter:
    """Counts the bytes of gathered tensors alive at once: every ``DTensor.redistribute`` (``full_tensor`` and
    torch's state-dict gathers go through it) adds its result's storage, which counts until it is freed. The
    largest sum seen when a gather returns is deterministic: no allocator or page-cache noise."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.live: list[tuple[StorageWeakRef, int]] = []
        self.most = self.largest = self.total = 0
        self._ref = StorageWeakRef

    def __enter__(self) -> GatherCounter:
        from torch.distributed.tensor import DTensor

        self._original = original = DTensor.redistribute

        def counted(tensor, *args, **kwargs):
            result = original(tensor, *args, **kwargs)
            storage = result._local_tensor.untyped_storage()
            self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
            self.live.append((self._ref(storage), storage.nbytes()))
            self.most = max(self.most, sum(n for _, n in self.live))
            self.largest = max(self.largest, storage.nbytes())
            self.total += storage.nbytes()
            return result

        DTensor.redistribute = counted
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.tensor import DTensor

        DTensor.redistribute = self._original


def measure_load(record: dict) -> None:
    """Record the high-water mark over each ``FSDP2Strategy.load_checkpoint`` into ``record``."""
    from ssl_xcit.parallel.fsdp import FSDP2Strategy

    load = FSDP2Strategy.load_checkpoint

    def measured(self, *args, **kwargs):
        reset_high_water()
        record["load_before_kib"] = resident_kib()
        file_pages = resident_kib("RssFile")
        checkpoint = load(self, *args, **kwargs)
        record["load_peak_kib"] = high_water_kib()
        record["load_file_kib"] = resident_kib("RssFile") - file_pages  # the checkpoint is still mapped
        return checkpoint

    FSDP2Strategy.load_checkpoint = measured


def _fit(backbone: str, depth: int, callbacks: list, ckpt_path=None, epochs: int = 1):
    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.dino.module import DINO

    L.seed_everything(0, verbose=False)
    kwargs = {"depth": depth, "patch_size": 8} if backbone.startswith("vit") else {"depth": depth}
    model = DINO(backbone, backbone_kwargs=kwargs, drop_path_rate=0.0, warmup_epochs=0, optimizer="adamw",
                 lr=1e-3, freeze_last_layer=0, **HEAD)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2_whole", max_epochs=epochs, limit_train_batches=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, use_distributed_sampler=False,
                        num_sanity_val_steps=0)  # fmt: skip
    dataset = Crops((16, 16, 8, 8))
    sampler = DistributedSampler(dataset, 2, int(os.environ["RANK"]), shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // 2, sampler=sampler, collate_fn=collate_train)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model


def main(out: Path, backbone: str, depth: int) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ssl_xcit.parallel.fsdp import whole_state_dict

    out.mkdir(parents=True, exist_ok=True)
    trainer, model = _fit(backbone, depth, [])
    strategy = trainer.strategy
    path = out / "whole.ckpt"
    reset_high_water()
    before = resident_kib()
    with GatherCounter() as gathers:
        trainer.save_checkpoint(path)
    save_peak = high_water_kib()
    rank = trainer.global_rank
    result = {"save_before_kib": before, "save_peak_kib": save_peak, "file_bytes": path.stat().st_size,
              "gathered_most": gathers.most, "gathered_largest": gathers.largest,
              "gathered_total": gathers.total}  # fmt: skip
    # The reference: Lightning's own gather of the whole state on rank 0 (empty elsewhere), as the file held it.
    reference = {
        "state_dict": ModelParallelStrategy.lightning_module_state_dict(strategy),
        "optimizer_states": [ModelParallelStrategy.optimizer_state(strategy, o) for o in trainer.optimizers],
    }
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    del reference
    networks = whole_state_dict(model)
    # Resumed in a fresh fit: the weights it loads are the saved ones, on every rank.
    measure_load(result)
    # Out of the page cache (the save just wrote it), so the file pages a rank maps are the ones it reads.
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    trainer.strategy.barrier()

    class Loaded(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = whole_state_dict(pl_module)
            self.optimizer = ModelParallelStrategy.optimizer_state(trainer.strategy, trainer.optimizers[0])

    loaded = Loaded()
    _fit(backbone, depth, [loaded], ckpt_path=path, epochs=2)
    result["loaded_equal"] = networks.keys() == loaded.state.keys() and all(
        torch.equal(loaded.state[k], v) for k, v in networks.items()
    )
    if rank == 0:  # the optimiser state as the resumed fit gathers it, against the saved run's
        torch.save(loaded.optimizer, out / "loaded_optimizer.pt")
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
