"""The FSDP2 rows of ``gpu_check.py`` (section ``fsdp2``), on CUDA with NCCL (gloo on a CPU for ``--dry-run``).

- ``fsdp2 1 process = 1 process``: ``--trainer.strategy fsdp2`` on a 1-GPU mesh (NCCL) against the plain
  1-process run (``gpu_check_ddp.py`` modes ``fsdp2`` and ``plain``), 32-true with TF32 off;
- ``fsdp2 2 = 1 process`` (2 or more GPUs): the same over 2 NCCL processes (the DDP row proves 2-process DDP
  equal to that 1-process run, so this is FSDP2 = DDP);
- ``fsdp2 bf16-mixed dtypes``: DINOv3's policy on the device: the first block computes in bf16, the sharded
  parameters stay float32 and their gradients arrive reduced in float32 (mode ``fsdp2_bf16``);
- ``fsdp2 sharded resume``: a sharded checkpoint written mid-run on the device, resumed after a crash, ends
  where the uninterrupted run ends, bit for bit (deterministic algorithms on); one process reads it whole.

As a worker, ``python gpu_check_fsdp2.py OUT WORLD_SIZE ACCELERATOR SIZE`` is the resume check's three fits
(``full``, ``crashed`` after step ``CRASH`` with the checkpoint of step ``EVERY``, ``resumed``), each rank's
result in OUT/resume_rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
STEPS, EVERY, CRASH = 3, 2, 3  # 3 optimiser steps an epoch; the checkpoint of step 2 is resumed


def _world(check: Any) -> int:
    """2 processes in the dry run (gloo) and with 2 or more GPUs; 1 on one GPU."""
    return 2 if check.dry or torch.cuda.device_count() >= 2 else 1


def _gpu_check(check: Any) -> Any:
    """gpu_check.py's module, however it was loaded: its ``Row``, worker launch and teacher runs."""
    return sys.modules[type(check).__module__]


def equality_row(row_type: Any, check: Any, world: int) -> Any:
    name = f"fsdp2 {world} = 1 process" if world > 1 else "fsdp2 1 process = 1 process"
    backend = ("gloo, CPU" if check.dry else "nccl") + f", {world} process(es)"
    if world > 1 and not check.dry and torch.cuda.device_count() < 2:
        return row_type(name, "nccl", f"n/a: needs 2 GPUs, found {torch.cuda.device_count()}", "skip")
    gpu_check = _gpu_check(check)
    one, fsdp = gpu_check.teacher_run(check, 1, "plain"), gpu_check.teacher_run(check, world, "fsdp2")
    for run in (one, fsdp):
        if isinstance(run, str):
            return row_type(name, backend, f"run failed: {run}", "fail")
    rtol, atol = 1e-4, 1e-5  # gpu_check's DDP row's: only the order of float32 sums differs
    diff, close = gpu_check.compare_teachers(one, fsdp, rtol, atol)
    ok = close and one["steps"] == fsdp["steps"] == 3
    setting = f"{backend}, 32-true (TF32 off), SGD, 3 steps of 16; tolerance rtol {rtol:g} atol {atol:g}"
    return row_type(name, setting, f"teacher max abs diff {diff:.2e} after {fsdp['steps']} steps",
                    "pass" if ok else "fail")  # fmt: skip


def dtype_row(row_type: Any, check: Any) -> Any:
    name, setting = "fsdp2 bf16-mixed dtypes", "1 process, bf16-mixed: block compute, sharded params, grads"
    run = _gpu_check(check).teacher_run(check, 1, "fsdp2_bf16")
    if isinstance(run, str):
        return row_type(name, setting, f"run failed: {run}", "fail")
    found = run["dtypes"]
    finite = all(bool(torch.isfinite(v).all()) for v in run["teacher"].values() if v.is_floating_point())
    ok = (found["compute"] == ["torch.bfloat16"] and found["params"] == ["DTensor torch.float32"]
          and found["grads"] == ["torch.float32"] and finite and run["steps"] == 3)  # fmt: skip
    result = f"compute {found['compute']}, params {found['params']}, grads {found['grads']}"
    return row_type(name, setting, result + ("" if finite else ", non-finite"), "pass" if ok else "fail")


def resume_row(row_type: Any, check: Any) -> Any:
    world = _world(check)
    name = "fsdp2 sharded resume"
    setting = (
        f"{'gloo, CPU' if check.dry else 'nccl'}, {world} process(es), checkpoint of step {EVERY} of {STEPS}"
    )
    out = check.tmp / "fsdp2_resume"
    out.mkdir(exist_ok=True)
    error = _gpu_check(check).launch(Path(__file__), world, str(out), str(world), check.accelerator,
                                     "32" if check.dry else "64")  # fmt: skip
    if error is not None:
        return row_type(name, setting, f"run failed: {error}", "fail")
    ranks = [torch.load(out / f"resume_rank{r}.pt", weights_only=True) for r in range(world)]
    differ = [k for r in ranks for k, v in r["full"].items() if not torch.equal(r["resumed"][k], v)]
    read = ranks[0]["read_whole"]
    ok = not differ and read and all(r["steps"] == [STEPS, CRASH, STEPS] for r in ranks)
    result = f"{len(differ)} teacher tensors differ; steps {ranks[0]['steps']}; folder read whole: {read}"
    return row_type(name, setting, result, "pass" if ok else "fail")


def rows(check: Any) -> list[Any]:
    row_type = _gpu_check(check).Row
    return [
        equality_row(row_type, check, 1),
        equality_row(row_type, check, 2),
        dtype_row(row_type, check),
        resume_row(row_type, check),
    ]


# ------------------------------------------------------------------------------------------- the worker
class Killed(Exception):
    """Ends the crashed fit after step ``CRASH``."""


def _fit(out: Path, world: int, accelerator: str, size: int, crash: int | None = None,
         ckpt: Path | None = None) -> tuple[dict[str, torch.Tensor], int]:  # fmt: skip
    import lightning as L
    from gpu_check_ddp import GLOBAL_BATCH, FixedCrops
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.data.resumable import resumable_loader
    from ssl_xcit.dino.module import DINO
    from ssl_xcit.trainer.fsdp import whole_state_dict

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if crash is not None and trainer.global_step >= crash:
                raise Killed  # stands for a kill: nothing after it is saved

    L.seed_everything(0, verbose=False)
    model = DINO(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, drop_path_rate=0.0, out_dim=64,
                 head_hidden_dim=32, head_bottleneck_dim=16, warmup_epochs=0, optimizer="sgd", lr=1.0,
                 freeze_last_layer=0, collapse_guard="off")  # fmt: skip
    saver = ModelCheckpoint(dirpath=out / "ckpt", filename="last", every_n_train_steps=EVERY,
                            enable_version_counter=False, save_on_train_epoch_end=False)  # fmt: skip
    trainer = L.Trainer(accelerator=accelerator, devices=world, strategy="fsdp2", precision="32-true",
                        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Crash(), saver] if crash else [], use_distributed_sampler=False,
                        enable_checkpointing=bool(crash))  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))  # the resumable loader keeps its position in the checkpoint
    loader = resumable_loader(FixedCrops(size), GLOBAL_BATCH // world, collate_train, world_size=world,
                              rank=rank, seed=0)  # fmt: skip
    try:
        trainer.fit(model, loader, ckpt_path=ckpt)
    except Killed:
        pass
    return {k: v.cpu() for k, v in whole_state_dict(model.teacher).items()}, trainer.global_step


def work(out: Path, world: int, accelerator: str, size: int) -> None:
    import ssl_xcit.trainer.fsdp  # noqa: F401 (registers the strategy names)
    from ssl_xcit.models import read_checkpoint

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    full, full_steps = _fit(out, world, accelerator, size)
    _, crashed_steps = _fit(out, world, accelerator, size, crash=CRASH)
    last = out / "ckpt" / "last.ckpt"
    resumed, resumed_steps = _fit(out, world, accelerator, size, ckpt=last)
    rank = int(os.environ.get("RANK", "0"))
    read_whole = False
    if rank == 0:  # one process, no process group needed: the folder's teacher is the checkpointed one
        state = read_checkpoint(last)["state_dict"]
        teacher = {k[len("teacher.") :]: v.shape for k, v in state.items() if k.startswith("teacher.")}
        read_whole = last.is_dir() and teacher == {k: v.shape for k, v in full.items()}
    result = {"full": full, "resumed": resumed, "steps": [full_steps, crashed_steps, resumed_steps],
              "read_whole": read_whole}  # fmt: skip
    torch.save(result, out / f"resume_rank{rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    work(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
