"""The invariants checked after each row's runs (``matrix_worker``), one column each: PASS, FAIL or n.a.

Tolerances (``TOLERANCE``) are relative to how far training moved a group of tensors: a comparison of runs
``a`` and ``b`` from the same start ``s`` passes when ``||a - b|| <= rtol * ||b - s||`` over the group
(student, teacher, centres, BatchNorm buffers, optimiser state).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from matrix_options import accumulation_exact, expected_refusal, strategy
from matrix_worker import census_module, skipped_micro_batches

COLUMNS = (
    "ranks equal", "2 proc = 1 proc", "accumulation = concatenation", "host reads",
    "finite, moved, steps", "resume = uninterrupted", "fused = foreach", "fsdp2 = ddp",
)  # fmt: skip
PASS, FAIL, NA = "PASS", "FAIL", "n.a."
REFUSED = "refused"  # a row FSDP2 must refuse did, on every run, with its one-line error

# Why these tolerances (relative to the training movement, see the module docstring; "measured": the largest
# ratio of the whole matrix, 2026-11-27):
# - 32-true: the runs differ only in the order of float32 sums (DDP adds two half-batch gradients; synced
#   BatchNorm adds two partial moments), ~1e-7 relative each; 4 SGD steps amplify that to 4e-6 measured. 1e-4
#   leaves margin, while a skipped gradient reduction (issue 42, defect 1) or BatchNorm statistics taken per
#   rank moved the weights by 7e-3 to 7e-2 of their movement.
# - 16-mixed: autocast rounds every matmul output to float16 (2^-11 ~ 4.9e-4 relative per rounding); another
#   batch split changes the kernels' blocking, so a few roundings fall the other way: 2e-4 measured, 1e-2 allowed.
# - bf16-mixed: the same with bfloat16's 8-bit significand (2^-8 ~ 3.9e-3 per rounding): 3e-3 measured on every
#   row but one, 5.4e-2 where DINO collapses within the 4 steps at this learning rate (its sharpened teacher
#   turns near-ties into different targets); 1e-1 allowed. The "ranks equal" column stays exact in every
#   precision, so a reduction error cannot hide behind this tolerance.
TOLERANCE = {"32-true": 1e-4, "16-mixed": 1e-2, "bf16-mixed": 1e-1}
# Host reads allowed per steady iteration of the epoch loop: none (docs/training.md), except under 16-mixed with
# a non-fused optimiser, chosen against the default: torch's GradScaler reads ``found_inf`` with ``.item()`` in
# the step of an optimiser that does not unscale itself (one read per optimiser step). Under a GradScaler the
# toolkit's default is the fused step (``ssl_xcit.dino.optim.fused_by_default``), which takes it on the device.
EXTRA_ALLOWANCE = {("16-mixed", "foreach"): 1}


def allowance(row: dict[str, str]) -> int:
    """The census's documented allowance for the row's precision (``loop_census.ALLOWANCE``), plus the above."""
    base = census_module().ALLOWANCE[row["precision"]]
    return base + EXTRA_ALLOWANCE.get((row["precision"], row["optimizer"]), 0)


CENSUS_WARMUP = 2  # first iterations: optimiser state, schedules and (compiled) graphs are made there
# Objectives whose 2-process run differs from the 1-process one by design: KoLeo's nearest neighbours are
# searched within each rank's batch (as DINOv2), iBOT's masks are drawn per rank (seeded by the rank).
PER_RANK = {"koleo": "KoLeo's neighbours are per rank", "ibot": "iBOT's masks are drawn per rank"}


def groups(state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """The state's keys by what they are: BatchNorm buffers, centres, student, teacher, the rest."""
    found: dict[str, list[str]] = {}
    for key in state:
        if any(key.endswith(s) for s in ("running_mean", "running_var", "num_batches_tracked")):
            group = "bn buffers"
        elif "center" in key:
            group = "centres"
        elif key.startswith(("student.", "teacher.")):
            group = key.split(".", 1)[0]
        else:
            group = "other"
        found.setdefault(group, []).append(key)
    return found


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def compare(a: dict, b: dict, start: dict[str, torch.Tensor], rtol: float) -> tuple[str, str]:
    """``a`` and ``b`` (runs' results) within ``rtol`` of ``b``'s movement from ``start``, group by group,
    the optimiser state (from zero) included; the detail names the worst group."""
    worst, name = 0.0, ""
    for group, keys in groups(b["state"]).items():
        if any(k not in a["state"] for k in keys):
            return FAIL, f"{group}: keys differ"
        diff = _norm([a["state"][k] - b["state"][k] for k in keys])
        moved = _norm([b["state"][k] - start[k] for k in keys if k in start])
        ratio = diff / moved if moved > 0 else (0.0 if diff == 0 else math.inf)
        if ratio > worst:
            worst, name = ratio, group
    pairs = list(zip(a["optimizer"], b["optimizer"], strict=True))
    keys = [(x, y, k) for x, y in pairs for k in y if k != "step"]
    diff = _norm([x[k] - y[k] for x, y, k in keys])
    moved = _norm([y[k] for _, y, k in keys])
    if moved > 0 and diff / moved > worst:
        worst, name = diff / moved, "optimiser"
    status = PASS if worst <= rtol else FAIL
    return status, f"{name} {worst:.1e}" if name else "0"


def _identical(a: dict, b: dict) -> tuple[str, str]:
    different = [k for k, v in b["state"].items() if not torch.equal(a["state"].get(k, v + 1), v)]
    opt = sum(
        not torch.equal(x[k], y[k]) for x, y in zip(a["optimizer"], b["optimizer"], strict=True) for k in y
    )
    if different or opt:
        return FAIL, f"{len(different)} tensors {different[:2]}, {opt} optimiser tensors"
    return PASS, ""


def expected_steps(row: dict[str, str], windows: int) -> tuple[int, int]:
    """(optimiser steps, skipped micro-batches) of a whole run of ``row``."""
    k, where = int(row["accumulate"]), row["unreadable"]
    if where == "none":
        return windows, 0
    if where == "every_rank":
        return windows - 1, k
    return windows - (k == 1), 1


def check_row(
    row: dict[str, str], two: list[dict] | None, one: dict, windows: int
) -> dict[str, tuple[str, str]]:
    """Every column for one row: ``two`` the 2-process ranks' runs (None: not run, one GPU), ``one`` the
    1-process runs."""
    expected = expected_refusal(row)
    if expected is not None:
        return {c: refused(expected, [*(two or []), one]) for c in COLUMNS}
    for runs in (*(two or []), one):
        if "refused" in runs:
            return {c: (FAIL, runs["refused"][:120]) for c in COLUMNS}
        if "error" in runs:
            message = runs["error"]["error"].splitlines()[0][:120]
            return {c: (FAIL, message) for c in COLUMNS}
    rtol = TOLERANCE[row["precision"]]
    start = one["initial"]["state"]
    full = [r["full"] for r in two] if two else []
    result: dict[str, tuple[str, str]] = {c: (NA, "1 process only") for c in COLUMNS}
    if two:
        result["ranks equal"] = _identical(full[0], full[1])
        if row["objective"] in PER_RANK:
            result["2 proc = 1 proc"] = (NA, PER_RANK[row["objective"]])
        else:
            result["2 proc = 1 proc"] = compare(full[0], one["single"], start, rtol)
        if any("resumed" not in r for r in two):
            result["resume = uninterrupted"] = (FAIL, "no pre-emption checkpoint was written")
        else:
            checks = [_identical(r["resumed"], r["full"]) for r in two]
            result["resume = uninterrupted"] = next((c for c in checks if c[0] == FAIL), checks[0])
    reason = accumulation_exact(row)
    if reason is not None:
        result["accumulation = concatenation"] = (NA, reason)
    else:
        result["accumulation = concatenation"] = compare(one["concat"], one["single"], start, rtol)
    # A compiled row's census ran in a fit of its own (``matrix_worker.censused_fit``).
    censuses = [r["census"] for r in (*(two or []), one) if "census" in r]
    censused = [r for r in (*full, one["single"], *censuses) if r.get("census") is not None]
    result["host reads"] = host_reads(censused, allowance(row), skipped_micro_batches(row))
    result["finite, moved, steps"] = finite_moved_steps(row, [*full, one["single"]], start, windows)
    if "twin" in one:
        result["fused = foreach"] = compare(one["single"], one["twin"], start, rtol)
    else:
        result["fused = foreach"] = (NA, "foreach row")
    if strategy(row) == "ddp":
        result["fsdp2 = ddp"] = (NA, "DDP row")
    elif row["precision"] == "bf16-mixed":
        result["fsdp2 = ddp"] = (NA, "bf16 weights (FSDP2) vs float32 weights under autocast (DDP)")
    else:  # the same process count: per-rank objectives compare too
        result["fsdp2 = ddp"] = compare(one["single"], one["ddp"], start, rtol)
    return result


def refused(expected: str, runs: list[dict]) -> tuple[str, str]:
    """Every run of a row FSDP2 must refuse ended with ``expected``, on one line."""
    for run in runs:
        message = run.get("refused")
        if message is None:
            return FAIL, f"not refused ({expected!r} expected)"
        if expected not in message or "\n" in message.strip():
            return FAIL, f"refused otherwise: {message[:120]}"
    return REFUSED, runs[0]["refused"]


def host_reads(runs: list[dict], allowance: int, skipped: list[int] = ()) -> tuple[str, str]:
    """The most host reads of a steady iteration: after the warm-up, no periodic read marked, and not a
    skipped micro-batch (its window's gradient all-reduce and the presence flags' read are a rare path,
    ``ssl_xcit.dino.optimizer_step``)."""
    worst, site = 0, ""
    for run in runs:
        for window in census_module().steady_windows(run["census"], CENSUS_WARMUP):
            if window["batch_idx"] in skipped:
                continue
            if len(window["found"]) > worst:
                worst, site = len(window["found"]), window["found"][0][1]
    return (PASS if worst <= allowance else FAIL), (f"{worst}: {site}" if worst else "0")


def finite_moved_steps(row: dict, runs: list[dict], start: dict, windows: int) -> tuple[str, str]:
    steps, skipped = expected_steps(row, windows)
    for run in runs:
        losses = [x for x in run["losses"] if x is not None]
        if not all(math.isfinite(x) for x in losses) or not all(
            torch.isfinite(v).all() for v in run["state"].values()
        ):
            return FAIL, "non-finite loss or weights"
        if run["global_step"] != steps or run["skipped"] != skipped:
            return FAIL, f"{run['global_step']} steps, {run['skipped']} skipped; expected {steps}, {skipped}"
        # The student first: only an optimiser step moves it. A DINO teacher alone is no proof, since its EMA
        # of an unmoved student (0.9 t + 0.1 t) still changes its last bits.
        for network in ("student", "teacher"):
            keys = [k for k in groups(run["state"]).get(network, []) if k in start]  # not BN buffers
            if keys and all(torch.equal(run["state"][k], start[k]) for k in keys):
                skips = run.get("scaler_skips")
                why = (
                    f": the GradScaler skipped {skips} of {steps} steps (inf/NaN gradients)" if skips else ""
                )
                return FAIL, f"the {network} did not move{why}"
    return PASS, ""


def load_row(out: Path, rid: str) -> tuple[list[dict], dict | None]:
    folder = out / rid
    two = [folder / f"ws2_rank{r}.pt" for r in range(2)]
    one = folder / "ws1_rank0.pt"
    load = lambda p: torch.load(p, weights_only=False) if p.exists() else None  # noqa: E731
    return [load(p) for p in two], load(one)


def table(rows: list[dict[str, str]], results: list[dict[str, tuple[str, str]]], axes: list[str]) -> str:
    """A Markdown table: one row per combination, one column per invariant (a FAIL shows its detail)."""
    head = [*axes, *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, result in zip(rows, results, strict=True):
        cells = [row[a] if a != "strategy" else strategy(row) for a in axes]
        for column in COLUMNS:
            status, detail = result[column]
            cells.append(status if status != FAIL else f"FAIL ({detail})".replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def missing(reason: str) -> dict[str, tuple[str, str]]:
    return {c: (FAIL, reason) for c in COLUMNS}


def results_for(out: Path, row: dict[str, str], rid: str, windows: int, distributed: bool = True) -> dict:
    two, one = load_row(out, rid)
    if one is None or (distributed and any(r is None for r in two)):
        return missing("no result (a hang or a crash: see the log)")
    return check_row(row, two if distributed else None, one, windows)
