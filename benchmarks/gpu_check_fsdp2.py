"""The FSDP2 rows of ``gpu_check.py`` (section ``fsdp2``), on CUDA with NCCL (gloo on a CPU for ``--dry-run``).

- ``fsdp2 1 process = 1 process``: ``--trainer.strategy fsdp2`` on a 1-GPU mesh (NCCL) against the plain
  1-process run (``gpu_check_ddp.py`` modes ``fsdp2`` and ``plain``), 32-true with TF32 off;
- ``fsdp2 2 = 1 process`` (2 or more GPUs): the same over 2 NCCL processes (the DDP row proves 2-process DDP
  equal to that 1-process run, so this is FSDP2 = DDP);
- ``fsdp2 bf16-mixed dtypes``: DINOv3's policy on the device: the first block computes in bf16, the sharded
  parameters stay float32 and their gradients arrive reduced in float32 (mode ``fsdp2_bf16``);
- ``fsdp2 sharded resume``: a sharded checkpoint written mid-run on the device, resumed after a crash, ends
  where the uninterrupted run ends, bit for bit; one process reads the checkpoint folder whole. The student
  draws drop-path masks (rate 0.1) from the device's generator, so the resume must restore every generator
  the step draws from (``ssl_xcit.utils.rng``). The uninterrupted reference runs twice (first and last of the
  worker's four fits) under ``torch.use_deterministic_algorithms(True, warn_only=True)``, cuDNN deterministic
  and not benchmarking, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: the row passes only when the two references are
  equal (a reproducible reference) and the resumed run equals it, and it says which of the two failed, with
  the largest difference, whether the generators end in the same state, and the operators torch warned
  about as nondeterministic on the device (each such warning names an operator whose kernel gives no
  repeatable bits, such as an atomic add in a backward).

As a worker, ``python gpu_check_fsdp2.py OUT WORLD_SIZE ACCELERATOR SIZE`` is the resume check's four fits
(``full``, ``crashed`` after step ``CRASH`` with the checkpoint of step ``EVERY``, ``resumed``, ``full``
again), each rank's result in OUT/resume_rank<r>.pt.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
STEPS, EVERY, CRASH = 3, 2, 3  # 3 optimiser steps an epoch; the checkpoint of step 2 is resumed
DETERMINISM = "deterministic algorithms (warn only), cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG=:4096:8"


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


def _differences(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> tuple[int, int, float]:
    """(tensors that differ, tensors compared, largest absolute difference) of two teachers' states."""
    differ = [k for k, v in one.items() if not torch.equal(other[k], v)]
    largest = max((float((other[k].double() - one[k].double()).abs().max()) for k in differ), default=0.0)
    return len(differ), len(one), largest


def resume_verdict(ranks: list[dict[str, Any]]) -> tuple[str, bool]:
    """The sharded-resume row's result and whether it passes, from each rank's worker result: the reference
    (``full``) run twice must be equal (else the reference is not reproducible: nondeterministic kernels), and
    the resumed run must equal it (else a state was not restored), with each rank's steps right and the
    folder read whole by rank 0."""
    ref = [_differences(r["full"], r["full_again"]) for r in ranks]
    res = [_differences(r["full"], r["resumed"]) for r in ranks]
    ref_n, res_n = sum(d[0] for d in ref), sum(d[0] for d in res)
    total = ref[0][1]
    reproducible, equal = ref_n == 0, res_n == 0
    steps_ok = all(r["steps"] == [STEPS, CRASH, STEPS, STEPS] for r in ranks)
    read = bool(ranks[0]["read_whole"])
    generators = sorted({g for r in ranks for g in r["generators"]})
    ops = sorted({op for r in ranks for op in r["nondeterministic"]})
    if reproducible:
        parts = [f"reference reproducible (run twice: 0 of {total} tensors differ)"]
    else:
        parts = [f"reference NOT reproducible: {ref_n} of {total} tensors differ between two uninterrupted "
                 f"runs, max {max(d[2] for d in ref):.1e}"]  # fmt: skip
    if equal:
        parts.append("resumed = reference bit for bit")
    else:
        parts.append(
            f"resumed differs from the first reference in {res_n} tensors, max {max(d[2] for d in res):.1e}"
        )
    parts.append(
        "generators end equal" if not generators else f"generators end differently: {', '.join(generators)}"
    )
    parts.append(ranks[0]["device_draws"] + " in the run")
    parts.append("nondeterministic ops warned: " + (", ".join(ops) if ops else "none"))
    parts.append(f"steps {ranks[0]['steps']}; folder read whole: {read}")
    if not reproducible:
        parts.append("cause: the reference itself (nondeterministic kernels), not the resume")
    elif not equal:
        parts.append("cause: a state the resume does not restore (the reference is reproducible)")
    return "; ".join(parts), reproducible and equal and steps_ok and read


def resume_row(row_type: Any, check: Any) -> Any:
    world = _world(check)
    name = "fsdp2 sharded resume"
    backend = "gloo, CPU" if check.dry else "nccl"
    setting = (
        f"{backend}, {world} process(es), checkpoint of step {EVERY} of {STEPS}, drop path 0.1; {DETERMINISM}"
    )
    out = check.tmp / "fsdp2_resume"
    out.mkdir(exist_ok=True)
    error = _gpu_check(check).launch(Path(__file__), world, str(out), str(world), check.accelerator,
                                     "32" if check.dry else "64")  # fmt: skip
    if error is not None:
        return row_type(name, setting, f"run failed: {error}", "fail")
    ranks = [torch.load(out / f"resume_rank{r}.pt", weights_only=True) for r in range(world)]
    result, ok = resume_verdict(ranks)
    return row_type(name, setting, result, "pass" if ok else "fail")


def planned(check: Any) -> list[Any]:
    """The section's rows for gpu_check's runner, each made when its turn comes."""
    gpu_check = _gpu_check(check)
    row_type, plan = gpu_check.Row, gpu_check.Planned
    return [
        plan("fsdp2 1 process = 1 process", "", lambda: equality_row(row_type, check, 1)),
        plan("fsdp2 2 = 1 process", "", lambda: equality_row(row_type, check, 2)),
        plan("fsdp2 bf16-mixed dtypes", "", lambda: dtype_row(row_type, check)),
        plan("fsdp2 sharded resume", DETERMINISM, lambda: resume_row(row_type, check)),
    ]


# ------------------------------------------------------------------------------------------- the worker
class Killed(Exception):
    """Ends the crashed fit after step ``CRASH``."""


NONDETERMINISTIC = re.compile(r"^(\S+) does not have a deterministic implementation")


def _generator_states() -> dict[str, torch.Tensor]:
    """The CPU generator's state and, on CUDA, the current device's."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _fit(out: Path, world: int, accelerator: str, size: int, crash: int | None = None,
         ckpt: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """One fit: the teacher's whole state, the optimiser steps made, the generators' states at the end of
    training and at its start (after any restore), and the operators torch warned about as
    nondeterministic."""
    import lightning as L
    from gpu_check_ddp import GLOBAL_BATCH, FixedCrops
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.data.resumable import resumable_loader
    from ssl_xcit.dino.module import DINO
    from ssl_xcit.parallel.fsdp import whole_state_dict

    generators: dict[str, dict[str, torch.Tensor]] = {}

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if crash is not None and trainer.global_step >= crash:
                raise Killed  # stands for a kill: nothing after it is saved

    class Generators(L.Callback):
        def on_train_start(self, trainer, pl_module):
            generators["start"] = _generator_states()

        def on_train_end(self, trainer, pl_module):
            generators["end"] = _generator_states()

    L.seed_everything(0, verbose=False)
    model = DINO(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, drop_path_rate=0.1, out_dim=64,
                 head_hidden_dim=32, head_bottleneck_dim=16, warmup_epochs=0, optimizer="sgd", lr=1.0,
                 freeze_last_layer=0, collapse_guard="off")  # fmt: skip
    saver = ModelCheckpoint(dirpath=out / "ckpt", filename="last", every_n_train_steps=EVERY,
                            enable_version_counter=False, save_on_train_epoch_end=False)  # fmt: skip
    trainer = L.Trainer(accelerator=accelerator, devices=world, strategy="fsdp2", precision="32-true",
                        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Generators(), *([Crash(), saver] if crash else [])],
                        use_distributed_sampler=False, enable_checkpointing=bool(crash),
                        deterministic="warn", benchmark=False)  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))  # the resumable loader keeps its position in the checkpoint
    loader = resumable_loader(FixedCrops(size), GLOBAL_BATCH // world, collate_train, world_size=world,
                              rank=rank, seed=0)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, loader, ckpt_path=ckpt)
        except Killed:
            pass
    ops = {m.group(1) for w in caught if (m := NONDETERMINISTIC.match(str(w.message)))}
    teacher = {k: v.cpu() for k, v in whole_state_dict(model.teacher).items()}
    return {
        "teacher": teacher,
        "steps": trainer.global_step,
        "generators": generators,
        "nondeterministic": ops,
    }


def work(out: Path, world: int, accelerator: str, size: int) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: repeatable sums
    import ssl_xcit.parallel.fsdp  # noqa: F401 (registers the strategy names)
    from ssl_xcit.models import read_checkpoint

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    full = _fit(out, world, accelerator, size)
    crashed = _fit(out, world, accelerator, size, crash=CRASH)
    last = out / "ckpt" / "last.ckpt"
    resumed = _fit(out, world, accelerator, size, ckpt=last)
    again = _fit(out, world, accelerator, size)  # the reference once more: is it reproducible at all?
    rank = int(os.environ.get("RANK", "0"))
    read_whole = False
    if rank == 0:  # one process, no process group needed: the folder's teacher is the checkpointed one
        state = read_checkpoint(last)["state_dict"]
        teacher = {k[len("teacher.") :]: v.shape for k, v in state.items() if k.startswith("teacher.")}
        read_whole = last.is_dir() and teacher == {k: v.shape for k, v in full["teacher"].items()}
    ends = (full["generators"]["end"], resumed["generators"]["end"])
    differ = [g for g in ends[0] if not torch.equal(ends[0][g], ends[1].get(g, torch.empty(0)))]
    start, end = full["generators"]["start"], full["generators"]["end"]
    stream = "cuda" if "cuda" in start else "cpu"  # the generator drop path draws from
    drawn = f"{stream} generator {'drawn' if not torch.equal(start[stream], end[stream]) else 'not drawn'}"
    runs = (full, crashed, resumed, again)
    result = {"full": full["teacher"], "resumed": resumed["teacher"], "full_again": again["teacher"],
              "steps": [r["steps"] for r in (full, crashed, resumed, again)], "read_whole": read_whole,
              "generators": differ, "device_draws": drawn,
              "nondeterministic": sorted(set().union(*(r["nondeterministic"] for r in runs)))}  # fmt: skip
    torch.save(result, out / f"resume_rank{rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    work(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
