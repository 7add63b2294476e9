"""One GPU check, one command: ``bash benchmarks/gpu_check.sh`` (this script does the work), one table.

Rows: the quickstart (``ssl-xcit fit -c recipes/quickstart.yaml``, short) in 16-mixed and bf16-mixed;
bf16-true's teacher movement against 32-true's (DINO refuses bf16-true: the row passes on the refusal);
KoLeo's neighbours under bf16 autocast against float64's; compile on and off; iBOT on and off (and both on:
compile must cover the masked pass); ``augment_on`` cpu and device; host syncs per step (``sync_count.py``),
with the recipe's progress bar off and on, and under 16-mixed with the toolkit's default optimiser for it;
images/s and MFU of the DINO step for XCiT-S12/16 and ViT-B/16 at two batch sizes, compile off and on, with
the first step's seconds (``gpu_check_throughput.py``); ``ssl-xcit plan`` against the measured peak memory
for four recipes and one FSDP2 configuration (``gpu_check_memory.py``); the invariant matrix's CUDA rows
(``gpu_check_matrix.py``); with 2 or more GPUs a 2-process NCCL run whose teacher must equal the 1-process
run's (``gpu_check_ddp.py``); FSDP2 on NCCL (``gpu_check_fsdp2.py``: 1 process, and 2 with 2 GPUs, equal to
the 1-process run; bf16-mixed's dtypes; a sharded checkpoint resumed bit for bit against a reference that is
itself run twice). Rows with the same settings share one run; with 2 GPUs also DDP + compile and DDP with 2
accumulated micro-batches, each against its 1-process run. A row passes when its run ends with the steps
asked for and finite weights and loss (and its own condition where it has one).

Time: each section has a budget (``SECTIONS``, seconds on one GPU, printed with the section); a section past
it is stopped (the row running then and every row after it are ``not run: budget``), and the whole check stops
at ``--max-seconds`` (470, and the start-up: 8 minutes; later sections are not run). Every row is printed as
it finishes and appended to ``--json`` (JSON Lines, default ``<--out>/rows.jsonl``: a ``start`` record, one
``row`` record per row, an ``end`` record), so a killed run leaves every finished row. ``--peer`` adds the
comparison with lightly's DINO (``bench_throughput.py``; section ``peer``, not in the default set). Exit
status 1 when a row fails, 3 when none failed but some were not run for lack of time.

``--dry-run`` runs the same rows on the CPU at tiny size (a 1-block model, 32/16 px crops, 2 steps, base
precision 32-true; 16-mixed runs with Lightning's CPU autocast), with every budget and ``--max-seconds``
multiplied by ``--budget-scale`` (50 there: inductor compiles for minutes on a shared CPU; 1 on a GPU); the
sync row runs its counter with the CPU proxy of ``sync_count.py`` but reports n/a (a CPU has nothing to wait
for); the 2-process rows use gloo; throughput and memory figures are a CPU's (MFU n.a.). ``--only NAME,...``
runs a subset of the sections (``--only precision,sync``; see ``SECTIONS``); ``--budgets NAME=S,...`` sets
sections' budgets (seconds before scaling).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECIPE = REPO / "recipes" / "quickstart.yaml"


@dataclass
class Row:
    name: str
    setting: str
    result: str
    status: str  # pass | fail | skip | not run


@dataclass
class Planned:
    """A row before it runs: its name and setting (those of its ``not run`` row if the budget ends first) and
    what makes it."""

    name: str
    setting: str
    make: Callable[[], Row]


class BudgetExceeded(BaseException):
    """A section's time is up (raised by the alarm; a BaseException, so that no ``except Exception`` of a row or
    of the code it runs turns it into a failed row)."""


@contextlib.contextmanager
def budget_alarm(seconds: float | None) -> Iterator[None]:
    """Raise :class:`BudgetExceeded` in this (the main) thread after ``seconds``; None: no limit."""
    if seconds is None:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise BudgetExceeded

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _alarm_held() -> Iterator[None]:
    """The alarm waits while a record is written (a row's JSON line is never cut in half); nested holds end with
    the outermost."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class Recorder:
    """Each row as it finishes: one line on ``out`` (the real stdout) and one JSON record appended to
    ``path``, flushed to disk before the next row starts."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out = path, out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def record(self, kind: str, **fields: Any) -> None:
        with _alarm_held(), self.path.open("a") as f:
            f.write(json.dumps({"kind": kind, "time": datetime.datetime.now().isoformat(timespec="seconds"),
                                **fields}) + "\n")  # fmt: skip
            f.flush()
            os.fsync(f.fileno())

    def say(self, line: str) -> None:
        with _alarm_held():
            print(line, file=self.out, flush=True)

    def row(self, section: str, row: Row, seconds: float) -> None:
        self.record("row", section=section, check=row.name, setting=row.setting, result=row.result,
                    status=row.status, seconds=round(seconds, 2))  # fmt: skip
        self.say(f"  {row.status:7s} {row.name} | {row.setting} | {row.result} ({seconds:.0f} s)")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"ssl_xcit_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_images(folder: Path, count: int = 24) -> Path:
    """Small photo-like JPEGs (the dry run's data: no k-NN, no synthetic-set generation)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
        small.resize((48, 48), Image.BICUBIC).save(folder / f"{i:03d}.jpg", quality=90)
    return folder


class Check:
    """The settings of one mode (GPU or dry run) and the runs already made (rows with equal settings share)."""

    def __init__(self, dry: bool, tmp: Path) -> None:
        self.dry, self.tmp = dry, tmp
        self.accelerator = "cpu" if dry else "cuda"
        self.steps = 2 if dry else 20
        self.base_precision = "32-true" if dry else "bf16-mixed"
        self.cache: dict[tuple[str, ...], Row] = {}
        train = [f"--trainer.accelerator={self.accelerator}", "--trainer.devices=1", "--trainer.num_nodes=1",
                 "--trainer.strategy=auto", "--trainer.max_epochs=1", f"--trainer.limit_train_batches={self.steps}",
                 "--trainer.limit_val_batches=2", "--data.init_args.augment_on=device"]  # fmt: skip
        if dry:
            data = tiny_images(tmp / "images")
            train += [
                "--model.init_args.backbone_kwargs={depth: 1}", "--model.init_args.out_dim=64",
                "--model.init_args.head_hidden_dim=32", "--model.init_args.head_bottleneck_dim=16",
                "--model.init_args.warmup_epochs=0", "--model.init_args.warmup_teacher_temp_epochs=0",
                f"--data.init_args.root={data}", "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
                "--data.init_args.persistent_workers=false", "--data.init_args.local_crops_number=2",
                "--data.init_args.global_crops_size=32", "--data.init_args.local_crops_size=16",
            ]  # fmt: skip
        else:
            train.append(f"--data.init_args.num_workers={max(1, min(8, (os.cpu_count() or 2) - 1))}")
        self.train = train

    def fit(self, *extra: str) -> Row:
        """``ssl-xcit fit -c recipes/quickstart.yaml`` with the short settings and ``extra``, in this process."""
        key = tuple(sorted(extra))
        if key in self.cache:
            return self.cache[key]
        from ssl_xcit.cli import main as cli_main

        run_dir = self.tmp / f"run{len(self.cache)}"
        argv = ["fit", "-c", str(RECIPE), *self.train, *extra, "--run_dir", str(run_dir)]
        start = time.perf_counter()
        try:
            cli = cli_main(argv)
        except BudgetExceeded:
            raise
        except BaseException as err:  # one failed run is one failed row, never the end of the table
            row = Row(
                "", "", f"{type(err).__name__}: {str(err).splitlines()[0][:90] if str(err) else ''}", "fail"
            )
        else:
            seconds = time.perf_counter() - start
            trainer, model = cli.trainer, cli.model
            loss = trainer.callback_metrics.get(
                "train/loss_epoch", trainer.callback_metrics.get("train/loss")
            )
            loss = float(loss) if loss is not None else math.nan
            finite = all(bool(torch.isfinite(p).all()) for p in model.teacher.parameters())
            ok = trainer.global_step == self.steps and math.isfinite(loss) and finite
            result = f"{trainer.global_step} steps, loss {loss:.3f}, {seconds:.0f} s"
            row = Row("", "", result + ("" if finite else ", non-finite weights"), "pass" if ok else "fail")
        self.cache[key] = row
        return row


def precision_plan(check: Check) -> list[Planned]:
    planned = []  # bf16-true is refused by DINO: its row is teacher_row's
    for precision in ("16-mixed", "bf16-mixed", *(("32-true",) if check.dry else ())):
        make = functools.partial(
            _named_fit, check, "quickstart", precision, f"--trainer.precision={precision}"
        )
        planned.append(Planned("quickstart", precision, make))
    return planned


def option_plan(check: Check, name: str) -> list[Planned]:
    """``name`` off and on at the base precision (the off run is the base run, shared)."""
    p = f"--trainer.precision={check.base_precision}"
    ibot, compile_ = "--model.init_args.ibot_loss_weight=1.0", "--model.init_args.compile=true"
    runs = {
        "compile": [("off", [p]), ("on", [p, compile_])],
        "ibot": [("off", [p]), ("on", [p, ibot]), ("on + compile", [p, ibot, compile_])],
        "augment_on": [("cpu", [p, "--data.init_args.augment_on=cpu"]), ("device", [p])],
    }[name]
    planned = []
    for value, extra in runs:
        setting = f"{value} ({check.base_precision})"
        planned.append(Planned(name, setting, functools.partial(_named_fit, check, name, setting, *extra)))
    return planned


def _named_fit(check: Check, name: str, setting: str, *extra: str) -> Row:
    return _named(check.fit(*extra), name, setting)


def _named(row: Row, name: str, setting: str) -> Row:
    return Row(name, setting, row.result, row.status)


def sync_row(check: Check, progress_bar: bool = False, precision: str | None = None) -> Row:
    """Host syncs per step of the quickstart (``gpu_check_sync.py`` describes the row)."""
    host = types.SimpleNamespace(**globals())  # this script's Row, RECIPE and helpers, however it was loaded
    return _load("gpu_check_sync").sync_row(host, check, progress_bar, precision)


def _quickstart_kwargs(check: Check) -> tuple[dict, dict]:
    """The quickstart recipe's DINO and data arguments (shrunk as in ``Check`` for the dry run)."""
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text())
    model_kw, data_kw = recipe["model"]["init_args"], {**recipe["data"]["init_args"], "augment_on": "device"}
    if check.dry:
        model_kw = {**model_kw, "backbone_kwargs": {"depth": 1}, "out_dim": 64, "warmup_epochs": 0}
        data_kw = {**data_kw, "root": str(check.tmp / "images"), "batch_size": 4, "num_workers": 0,
                   "persistent_workers": False, "global_crops_size": 32, "local_crops_size": 16}  # fmt: skip
    return model_kw, data_kw


def _teacher_distance(check: Check, precision: str, steps: int) -> float:
    """How far the teacher's parameters move (L2 over all of them) in ``steps`` steps of the quickstart's
    model at teacher momentum 0.9995 (where a DINO run spends its end), in ``precision``."""
    import lightning as L

    from ssl_xcit.data.datamodule import DINODataModule
    from ssl_xcit.dino.module import DINO

    model_kw, data_kw = _quickstart_kwargs(check)
    L.seed_everything(0, verbose=False)
    model = DINO(**{**model_kw, "momentum_teacher": 0.9995, "collapse_guard": "off"})
    before: list[torch.Tensor] = []

    class Start(L.Callback):  # after the precision plugin has cast the weights
        def on_train_start(self, trainer, pl_module):
            before.extend(p.detach().float().clone() for p in pl_module.teacher.parameters())

    trainer = L.Trainer(
        accelerator=check.accelerator, devices=1, precision=precision, max_epochs=1, limit_train_batches=steps,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Start()],
    )  # fmt: skip
    trainer.fit(model, DINODataModule(**data_kw))
    if trainer.global_step != steps:
        raise RuntimeError(f"{precision} ran {trainer.global_step} of {steps} steps")
    after = [p.detach().float() for p in model.teacher.parameters()]
    return math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(after, before, strict=True)))


def teacher_row(check: Check) -> Row:
    """Teacher movement in bf16-true against 32-true. DINO refuses bf16-true (its EMA update rounds away in
    bfloat16 weights: ``ssl_xcit.dino.precision``), and the row passes on that one-line refusal; should
    bf16-true ever train, it passes when its teacher moves at least half as far as in 32-true."""
    from ssl_xcit.errors import UserError

    steps = 2 if check.dry else 8
    setting = f"quickstart, momentum 0.9995, {steps} steps; pass: refused, or ratio >= 0.5"
    try:
        moved = _teacher_distance(check, "bf16-true", steps)
    except UserError as err:
        refused = "bf16-mixed" in str(err)
        return Row(
            "teacher in bf16-true",
            setting,
            "refused: " + str(err).split("; ")[-1],
            "pass" if refused else "fail",
        )
    ratio = moved / max(_teacher_distance(check, "32-true", steps), 1e-30)
    return Row(
        "teacher in bf16-true",
        setting,
        f"moves {ratio:.3f} x 32-true's distance",
        "pass" if ratio >= 0.5 else "fail",
    )


def koleo_row(check: Check) -> Row:
    """KoLeo's nearest neighbours under bf16 autocast (and TF32 float32 matmuls) against float64 ones, on a
    near-collapsed batch (the regime KoLeo exists for), where bf16 products tie."""
    import torch.nn.functional as F

    from ssl_xcit.dino.koleo import koleo_loss, nearest_neighbours

    device = torch.device(check.accelerator)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 384, generator=g) + 0.01 * torch.randn(64, 384, generator=g)
    unit = F.normalize(x, dim=1)
    exact = (unit.double() @ unit.double().T).fill_diagonal_(-2.0).argmax(1)
    naive = (unit.bfloat16() @ unit.bfloat16().T).float().fill_diagonal_(-2.0).argmax(1)  # what autocast made
    reference = float(koleo_loss(x))
    matmul = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 products where the GPU has them
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            nearest = nearest_neighbours(F.normalize(x.to(device), dim=1)).cpu()
            loss = float(koleo_loss(x.to(device)))
    finally:
        torch.set_float32_matmul_precision(matmul)
    same = int((nearest == exact).sum())
    ok = same == len(exact) and abs(loss - reference) <= 1e-4 * abs(reference)
    setting = "64 x 384, every cosine > 0.999; bf16 autocast, TF32 matmuls"
    result = f"{same}/64 neighbours exact (bf16 products: {int((naive == exact).sum())}/64); loss {loss:.4f} vs {reference:.4f}"
    return Row("koleo under bf16-mixed", setting, result, "pass" if ok else "fail")


def throughput_row(check: Check) -> Row:
    bench = _load("bench_throughput")
    if check.dry:
        argv = ["--ci", "--device", "cpu"]
    else:
        workers = max(1, min(8, (os.cpu_count() or 2) - 1))
        argv = ["--model", "xcit_small_12_p16", "--batch-size", "64", "--workers", str(workers), "--data",
                "synthetic", "--steps", "10", "--warmup", "3", "--fused"]  # fmt: skip
    out = bench.main(argv)
    ratio = out["ceiling"] / out["peer"] if out["peer"] else None
    mfu = (
        f"MFU {100 * out['ceiling'] * out['flops_per_image'] / out['peak']:.1f} %"
        if out["peak"]
        else "MFU n/a"
    )
    result = f"ceiling {out['ceiling']:.1f} images/s, {mfu}, loader {out['loader']:.1f} images/s; "
    result += f"ours/peer {ratio:.2f}x" if ratio else f"peer skipped: {out['peer_skipped'].split(' (')[0]}"
    measured = all(math.isfinite(out[k]) and out[k] > 0 for k in ("ceiling", "loader", "through_loader"))
    # On a GPU the peer ratio is the target (>= 1.2x); on the CPU dry run it is only reported.
    ok = measured and (check.dry or ratio is None or ratio >= 1.2)
    return Row("throughput", " ".join(argv), result, "pass" if ok else "fail")


# The 2-process rows (gpu_check_ddp.py's modes): name, what the runs add, tolerance (rtol, atol). Compiled
# kernels may sum in another order for another batch size (8 a rank against 16), hence a looser tolerance.
DDP_ROWS = {
    "plain": ("ddp 2 = 1 process", "", (1e-4, 1e-5)),
    "compile": ("ddp 2 + compile = 1 process", "compile on both, ", (1e-3, 1e-4)),
    "accumulate": ("ddp 2, accumulate 2 = 1 process", "2 micro-batches of 8 a step on both, ", (1e-4, 1e-5)),
}


def worker_env() -> dict[str, str]:
    """The environment of a worker process: one thread, this repository importable, cuBLAS deterministic (the
    sharded-resume row compares bits)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def launch(script: Path, world: int, *args: str) -> str | None:
    """``script`` on ``world`` processes (torchrun for 2); the last line of its error, or None."""
    cmd = [sys.executable, str(script)]
    if world > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
               f"--master_port={port}", str(script)]  # fmt: skip
    # Its own session: a budget's end (or any other interruption) kills torchrun and its workers together.
    proc = subprocess.Popen([*cmd, *args], env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=600)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        lines = stderr.strip().splitlines() or ["(no output)"]
        return lines[-1][:90]
    return None


def teacher_run(check: Check, world: int, mode: str) -> dict | str:
    """``gpu_check_ddp.py``'s run of ``mode`` on ``world`` processes (made once per check: the DDP and FSDP2
    rows share the 1-process run), or its error."""
    out = check.tmp / "ddp"
    out.mkdir(exist_ok=True)
    path = out / f"teacher_ws{world}_{mode}.pt"
    if not path.exists():
        size = "32" if check.dry else "64"
        error = launch(HERE / "gpu_check_ddp.py", world, str(out), str(world), check.accelerator, size, mode)
        if error is not None:
            return error
    return torch.load(path, weights_only=True)


def compare_teachers(one: dict, other: dict, rtol: float, atol: float) -> tuple[float, bool]:
    """The largest absolute difference of two runs' teachers, and whether they hold the same tensors, each
    within ``rtol`` / ``atol``."""
    diff = max(
        float((one["teacher"][k].float() - v.float()).abs().max()) for k, v in other["teacher"].items()
    )
    close = other["teacher"].keys() == one["teacher"].keys() and all(
        torch.allclose(v.float(), one["teacher"][k].float(), rtol=rtol, atol=atol)
        for k, v in other["teacher"].items()
    )
    return diff, close


def ddp_row(check: Check, mode: str = "plain") -> Row:
    name, adds, (rtol, atol) = DDP_ROWS[mode]
    if not check.dry and torch.cuda.device_count() < 2:
        if mode == "plain":
            return Row(name, "nccl", f"skipped: {torch.cuda.device_count()} GPU(s)", "skip")
        return Row(name, "nccl", f"n/a: needs 2 GPUs, found {torch.cuda.device_count()}", "skip")
    one, two = teacher_run(check, 1, mode), teacher_run(check, 2, mode)
    for run in (one, two):
        if isinstance(run, str):
            return Row(name, "", f"run failed: {run}", "fail")
    diff, close = compare_teachers(one, two, rtol, atol)
    moved = one["steps"] == two["steps"] == 3
    backend = "gloo, CPU" if check.dry else "nccl"
    if check.dry and mode == "compile":
        backend += ", aot_eager"  # gpu_check_ddp.py says why
    setting = (
        f"{backend}, 32-true (TF32 off), SGD, {adds}3 steps of 16; tolerance rtol {rtol:g} atol {atol:g}"
    )
    result = f"teacher max abs diff {diff:.2e} after {two['steps']} steps"
    return Row(name, setting, result, "pass" if (moved and close) else "fail")


def table(rows: list[Row]) -> str:
    head = ["check", "setting", "result", "status"]
    cells = [head, *[[r.name, r.setting, r.result, r.status] for r in rows]]
    width = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["| " + " | ".join(c[i].ljust(width[i]) for i in range(4)) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    return "\n".join(lines)


@dataclass
class Section:
    """A section: its rows (planned before any runs) and its time budget in seconds on one GPU."""

    budget: float
    plan: Callable[[Check], list[Planned]]


def _one(name: str, make: Callable[[Check], Row], setting: str = "") -> Callable[[Check], list[Planned]]:
    return lambda c: [Planned(name, setting, functools.partial(make, c))]


def _sync_plan(check: Check, *variants: dict) -> list[Planned]:
    """``sync_row``'s rows, one per keyword set (named as sync_row names them)."""
    planned = []
    for kw in variants:
        name = "host syncs per step" + (" (progress bar on)" if kw.get("progress_bar") else "")
        name += f" ({kw['precision']})" if "precision" in kw else ""
        planned.append(Planned(name, "quickstart", functools.partial(sync_row, check, **kw)))
    return planned


def _ddp_plan(mode: str) -> Callable[[Check], list[Planned]]:
    return _one(DDP_ROWS[mode][0], lambda c: ddp_row(c, mode))


# The budgets (seconds on one GPU, first estimates: the first GPU run, issue 51, found the augment, iBOT and
# compile rows together past 150 s) add up to 460 s with the n/a DDP rows of one GPU taking none.
SECTIONS: dict[str, Section] = {
    "precision": Section(40, precision_plan),
    "compile": Section(45, lambda c: option_plan(c, "compile")),
    "ibot": Section(50, lambda c: option_plan(c, "ibot")),
    "augment": Section(15, lambda c: option_plan(c, "augment_on")),
    "numerics": Section(10, lambda c: [Planned("teacher in bf16-true", "", functools.partial(teacher_row, c)),
                                       Planned("koleo under bf16-mixed", "", functools.partial(koleo_row, c))]),
    "sync": Section(20, lambda c: _sync_plan(c, {}, {"progress_bar": True})),
    "sync_fp16": Section(15, lambda c: _sync_plan(c, {"precision": "16-mixed"})),
    "throughput": Section(150, lambda c: _load("gpu_check_throughput").planned(c)),
    "memory": Section(40, lambda c: _load("gpu_check_memory").planned(c)),
    "ddp": Section(30, _ddp_plan("plain")),
    "ddp_compile": Section(60, _ddp_plan("compile")),
    "ddp_accumulate": Section(30, _ddp_plan("accumulate")),
    "matrix": Section(25, lambda c: _load("gpu_check_matrix").planned(c)),
    "fsdp2": Section(50, lambda c: _load("gpu_check_fsdp2").planned(c)),
    "peer": Section(60, _one("throughput", throughput_row)),
}  # fmt: skip
DEFAULT_SECTIONS = [name for name in SECTIONS if name != "peer"]  # --peer adds it
MAX_SECONDS = 470.0  # from the start of main(); importing torch and Lightning comes before


def run_section(name: str, check: Check, budget: float, recorder: Recorder, limit: str = "") -> list[Row]:
    """The section's rows, each recorded as it finishes; past ``budget`` seconds the running row and the rest
    are ``not run`` (``limit``, when given, says the whole check's time is what ran out). A section that cannot
    even plan its rows is one failed row."""
    rows: list[Row] = []
    planned: list[Planned] | None = None
    started = time.perf_counter()
    recorder.say(f"section {name}: budget {_secs(budget)} s{f' ({limit})' if limit else ''}")
    try:
        if budget <= 0:  # nothing left: the rows' names only
            planned = SECTIONS[name].plan(check)
            raise BudgetExceeded
        with budget_alarm(budget), contextlib.redirect_stdout(sys.stderr):  # stdout: the rows alone
            planned = SECTIONS[name].plan(check)
            for item in planned:
                begun = time.perf_counter()
                try:
                    row = item.make()
                except Exception as err:  # a crash is a failed row, and the table still prints
                    row = Row(item.name, item.setting, f"{type(err).__name__}: {_first_line(err)}", "fail")
                with _alarm_held():
                    rows.append(row)
                    recorder.row(name, row, time.perf_counter() - begun)
    except BudgetExceeded:
        spent = time.perf_counter() - started
        gc.collect()  # what the stopped run held
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if planned is None:  # stopped while planning: the rows' names, without a limit this time
            try:
                planned = SECTIONS[name].plan(check)
            except Exception:
                planned = [Planned(name, "", lambda: Row("", "", "", ""))]
        cut = planned[len(rows) :]
        why = f"not run: {limit or f'budget ({_secs(budget)} s)'} spent"
        for i, item in enumerate(cut):
            row = Row(item.name, item.setting, why + (f", stopped {spent:.0f} s in" if i == 0 and budget > 0 else ""),
                      "not run")  # fmt: skip
            rows.append(row)
            recorder.row(name, row, 0.0)
    except Exception as err:  # the plan itself failed
        row = Row(name, "", f"{type(err).__name__}: {_first_line(err)}", "fail")
        rows.append(row)
        recorder.row(name, row, time.perf_counter() - started)
    return rows


def _secs(seconds: float) -> str:
    return f"{round(seconds, 1):g}"


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0][:90] if str(err) else ""


def _budgets(text: str, parser: argparse.ArgumentParser) -> dict[str, float]:
    budgets = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if name not in SECTIONS or not value:
            parser.error(
                f"--budgets takes NAME=SECONDS,... with NAME one of {', '.join(SECTIONS)}; got {item!r}"
            )
        budgets[name] = float(value)
    return budgets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the same rows on the CPU at tiny size")
    p.add_argument(
        "--only", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}"
    )
    p.add_argument("--peer", action="store_true", help="add the section 'peer' (ours against lightly's DINO)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/gpu_check/<time>)")
    p.add_argument(
        "--json", type=Path, default=None, help="the rows as JSON Lines (default <out>/rows.jsonl)"
    )
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS, help="the whole check's limit")
    p.add_argument("--budget-scale", type=float, default=None, help="budgets x this (default 1; dry run 50)")
    p.add_argument("--budgets", default="", help="NAME=SECONDS,...: these sections' budgets instead")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.peer and "peer" not in only:
        only.append("peer")
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        p.error(f"unknown --only {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    budgets = {name: SECTIONS[name].budget for name in SECTIONS} | _budgets(args.budgets, p)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --dry-run for the CPU version of every check")
    from ssl_xcit.cli.quiet import install_filters

    install_filters()
    scale = args.budget_scale if args.budget_scale is not None else (50.0 if args.dry_run else 1.0)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out if args.out is not None else REPO / "runs" / "gpu_check" / stamp
    recorder = Recorder(args.json if args.json is not None else out / "rows.jsonl", sys.stdout)
    device = "CPU dry run" if args.dry_run else torch.cuda.get_device_name(0)
    start = time.perf_counter()
    deadline = start + args.max_seconds * scale
    recorder.record("start", device=device, torch=torch.__version__, dry_run=args.dry_run, sections=only,
                    budgets={n: budgets[n] * scale for n in only}, max_seconds=args.max_seconds * scale)  # fmt: skip
    recorder.say(f"gpu_check on {device}: rows as they finish in {recorder.path}; at most "
                 f"{args.max_seconds * scale:.0f} s")  # fmt: skip
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        check = Check(args.dry_run, Path(tmp))
        for name in only:
            left = max(deadline - time.perf_counter(), 0.0)
            budget = budgets[name] * scale
            limit = f"the check's {args.max_seconds * scale:.0f} s" if left < budget else ""
            rows += run_section(name, check, min(budget, left), recorder, limit)
    seconds = time.perf_counter() - start
    recorder.record("end", seconds=round(seconds, 1), failed=sum(r.status == "fail" for r in rows),
                    not_run=sum(r.status == "not run" for r in rows))  # fmt: skip
    print(f"\ngpu_check on {device}, torch {torch.__version__}, {seconds:.0f} s; rows in {recorder.path}")
    print(table(rows))
    if any(r.status == "fail" for r in rows):
        return 1
    return 3 if any(r.status == "not run" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
