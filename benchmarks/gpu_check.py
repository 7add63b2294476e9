"""One GPU check, one command: ``bash benchmarks/gpu_check.sh`` (this script does the work), one table.

Rows: the quickstart (``ssl-xcit fit -c recipes/quickstart.yaml``, short) in 16-mixed and bf16-mixed;
bf16-true's teacher movement against 32-true's (DINO refuses bf16-true: the row passes on the refusal);
KoLeo's neighbours under bf16 autocast against float64's; compile on and off; iBOT on and off (and both on:
compile must cover the masked pass); ``augment_on`` cpu and device; host syncs per step (``sync_count.py``),
with the recipe's progress bar off and on, and under 16-mixed with the toolkit's default optimiser for it;
the throughput benchmark; the invariant matrix's CUDA rows (``MATRIX_ROWS``: ``gpu_check_matrix.py``); with 2 or
more GPUs a 2-process NCCL run whose teacher must equal the 1-process run's (``gpu_check_ddp.py``); FSDP2 on
NCCL (``gpu_check_fsdp2.py``: 1 process, and 2 with 2 GPUs, equal to the 1-process run; bf16-mixed's dtypes;
a sharded checkpoint resumed bit for bit). Rows with
the same settings share one run; with 2 GPUs also DDP + compile and DDP with 2 accumulated micro-batches, each
against its 1-process run. A row passes when its run ends with the steps asked for and finite weights
and loss (and its own condition where it has one). Exit status 1 when any row fails.

``--dry-run`` runs the same rows on the CPU at tiny size (a 1-block model, 32/16 px crops, 2 steps, base
precision 32-true; 16-mixed runs with Lightning's CPU autocast); the sync row
runs its counter with the CPU proxy of ``sync_count.py`` but reports n/a (a CPU has nothing to wait for); the
2-process row uses gloo. ``--only NAME,...`` runs a subset of the sections (``--only precision,sync``; see
``SECTIONS``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECIPE = REPO / "recipes" / "quickstart.yaml"


@dataclass
class Row:
    name: str
    setting: str
    result: str
    status: str  # pass | fail | skip


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


def precision_rows(check: Check) -> list[Row]:
    rows = []  # bf16-true is refused by DINO: its row is teacher_row's
    for precision in ("16-mixed", "bf16-mixed", *(("32-true",) if check.dry else ())):
        rows.append(_named(check.fit(f"--trainer.precision={precision}"), "quickstart", precision))
    return rows


def option_rows(check: Check, name: str) -> list[Row]:
    """``name`` off and on at the base precision (the off run is the base run, shared)."""
    p = f"--trainer.precision={check.base_precision}"
    ibot, compile_ = "--model.init_args.ibot_loss_weight=1.0", "--model.init_args.compile=true"
    runs = {
        "compile": [("off", [p]), ("on", [p, compile_])],
        "ibot": [("off", [p]), ("on", [p, ibot]), ("on + compile", [p, ibot, compile_])],
        "augment_on": [("cpu", [p, "--data.init_args.augment_on=cpu"]), ("device", [p])],
    }[name]
    return [_named(check.fit(*extra), name, f"{value} ({check.base_precision})") for value, extra in runs]


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
    proc = subprocess.run([*cmd, *args], env=worker_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no output)"]
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


def matrix_rows(check: Check) -> list[Row]:
    """The invariant matrix's CUDA subset (NCCL with 2 or more GPUs): each function in ``MATRIX_ROWS`` takes the
    ``Check`` and returns its rows (``gpu_check_matrix.py``: tests/invariants' mixed-precision rows)."""
    return [row for make in MATRIX_ROWS for row in make(check)]


MATRIX_ROWS: list[Callable[[Check], list[Row]]] = [lambda c: _load("gpu_check_matrix").matrix_rows(c)]

SECTIONS: dict[str, Callable[[Check], list[Row]]] = {
    "precision": precision_rows,
    "compile": lambda c: option_rows(c, "compile"),
    "ibot": lambda c: option_rows(c, "ibot"),
    "augment": lambda c: option_rows(c, "augment_on"),
    "numerics": lambda c: [teacher_row(c), koleo_row(c)],
    "sync": lambda c: [sync_row(c), sync_row(c, progress_bar=True)],
    "sync_fp16": lambda c: [sync_row(c, precision="16-mixed")],
    "throughput": lambda c: [throughput_row(c)],
    "ddp": lambda c: [ddp_row(c)],
    "ddp_compile": lambda c: [ddp_row(c, "compile")],
    "ddp_accumulate": lambda c: [ddp_row(c, "accumulate")],
    "matrix": matrix_rows,
    "fsdp2": lambda c: _load("gpu_check_fsdp2").rows(c),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the same rows on the CPU at tiny size")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        p.error(f"unknown --only {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --dry-run for the CPU version of every check")
    from ssl_xcit.cli.quiet import install_filters

    install_filters()
    start = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        check = Check(args.dry_run, Path(tmp))
        for name in only:
            try:  # the runs' own output goes to stderr: stdout holds the table alone
                with contextlib.redirect_stdout(sys.stderr):
                    rows += SECTIONS[name](check)
            except Exception as err:  # a crash is a failed row, and the table still prints
                rows.append(Row(name, "", f"{type(err).__name__}: {str(err).splitlines()[0][:90]}", "fail"))
    device = "CPU dry run" if args.dry_run else torch.cuda.get_device_name(0)
    print(f"\ngpu_check on {device}, torch {torch.__version__}, {time.perf_counter() - start:.0f} s")
    print(table(rows))
    return 1 if any(r.status == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
