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
from matrix_worker import census_module, readable_copy, skipped_micro_batches

COLUMNS = (
    "ranks equal", "2 proc = 1 proc", "accumulation = concatenation", "skipped = readable mean", "host reads",
    "finite, moved, steps", "resume = uninterrupted", "fused = foreach", "fsdp2 = ddp",
)  # fmt: skip
PASS, FAIL, NA = "PASS", "FAIL", "n.a."
REFUSED = "refused"  # a row FSDP2 must refuse did, on every run, with its one-line error

# Why these weight tolerances (relative to the training movement, see the module docstring; "measured": the
# largest ratio of the whole matrix, 2026-11-27):
# - 32-true: the runs differ only in the order of float32 sums (DDP adds two half-batch gradients; synced
#   BatchNorm adds two partial moments), ~1e-7 relative each; 4 SGD steps amplify that to 4e-6 measured.
# - 16-mixed: autocast rounds every matmul output to float16 (2^-11 ~ 4.9e-4 relative per rounding); another
#   batch split changes the kernels' blocking, so a few roundings fall the other way: 2e-4 measured, 1e-2 allowed.
# - bf16-mixed: the same with bfloat16's 8-bit significand (2^-8 ~ 3.9e-3 per rounding): 3e-3 measured on every
#   row but one, 5.4e-2 where DINO collapses within the 4 steps at this learning rate (its sharpened teacher
#   turns near-ties into different targets); 1e-1 allowed.
# The weights are a weak witness of a window's defect: the per-parameter clip caps each gradient's norm at 3, so a
# doubled window gradient moved them by 2.9e-2 of their movement in bf16 (inside 1e-1) and a missing reduction by
# 3.1e-4 (issue 50's review). Such defects are caught by each window's gradients (GRADIENT_TOLERANCE, below) and
# by "ranks equal", which is exact; tests/invariants/mutants.py shows each one caught in every precision.
TOLERANCE = {"32-true": 1e-4, "16-mixed": 1e-2, "bf16-mixed": 1e-1}
# AdamW rows' weights: its division by sqrt(v) turns the float noise of a near-zero gradient into a full-size step
# of either sign (measured 1e-3 in 32-true), so the weights compare loosely, and their gradients (below, before
# AdamW touches them) carry the check's rigour.
ADAMW_TOLERANCE = {"32-true": 1e-2, "16-mixed": 1e-1, "bf16-mixed": 1e-1}
# The first GRADIENT_WINDOWS windows' gradients (``compare_gradients``: reduced, the readable micro-batches' mean,
# unscaled, before the clip), relative to their norm over all parameters. Window 0 starts from the same weights in
# every run and window 1 holds every event of a row (its unreadable micro-batch, the pre-emption), so a defect of
# a window's gradient shows there undiluted: a doubled gradient is 1.0, a rank's own gradient instead of the mean
# ~0.5. Later windows start from weights that the precision's noise has moved apart, chaotically under bf16 (0.23
# measured in window 3), and are left to the weights' check. Measured in windows 0-1 (2026-11-28): 1e-6 in
# 32-true, 8e-4 in 16-mixed, 2.5e-2 in bf16-mixed.
GRADIENT_WINDOWS = 2
GRADIENT_TOLERANCE = {"32-true": 1e-4, "16-mixed": 1e-2, "bf16-mixed": 1e-1}
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


def per_rank(row: dict[str, str]) -> str | None:
    """Why ``row``'s 2-process run differs from its 1-process one by design (``PER_RANK``), or None. KoLeo over
    groups (``koleo_group_size``) of at least a global micro-batch finds the same neighbours in both runs."""
    from matrix_options import setting
    from matrix_worker import MICRO, OPTIMS, WORLD

    group = OPTIMS[setting(row, "optim")].get("koleo_group_size")
    if row["objective"] == "koleo" and group is not None and group >= MICRO * WORLD:
        return None
    return PER_RANK.get(row["objective"])


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


def compare(
    a: dict,
    b: dict,
    start: dict[str, torch.Tensor],
    tol: tuple[float, float],
    exclude: tuple[str, ...] = (),
    world: int = 1,
) -> tuple[str, str]:
    """``a`` and ``b`` (runs' results) within ``tol[0]`` of ``b``'s movement from ``start``, group by group,
    the optimiser state (from zero) included, and the first windows' gradients within ``tol[1]``
    (``compare_gradients``) where both runs recorded them; the detail names the worst group. ``exclude``:
    groups left out. ``tol``: ``tolerance(row)``. ``world``: ``a`` is rank 0 of that many FSDP2 processes (its
    gradients are shards) and ``b`` a 1-process run."""
    gradients = (PASS, "")
    if "gradients" in a and "gradients" in b:
        gradients = compare_gradients(a["gradients"], b["gradients"], tol[1], 0, world)
    weights = _compare_states(a, b, start, tol[0], exclude)
    return gradients if gradients[0] == FAIL else weights


def tolerance(row: dict[str, str]) -> tuple[float, float]:
    """(weights, gradients) tolerances of ``row``'s comparisons: ``TOLERANCE`` (``ADAMW_TOLERANCE`` for the
    weights of an AdamW row) and ``GRADIENT_TOLERANCE``."""
    weights = (ADAMW_TOLERANCE if row["optimizer"] == "adamw" else TOLERANCE)[row["precision"]]
    return weights, GRADIENT_TOLERANCE[row["precision"]]


def _compare_states(
    a: dict, b: dict, start: dict[str, torch.Tensor], rtol: float, exclude: tuple[str, ...] = ()
) -> tuple[str, str]:
    worst, name = 0.0, ""
    for group, keys in groups(b["state"]).items():
        if group in exclude:
            continue
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


def shard_of(whole: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``whole`` as FSDP2 shards it (``Shard(0)``, ``torch.chunk``'s sizes; a rank past
    the last chunk holds an empty one)."""
    pieces = torch.chunk(whole, world, dim=0) if whole.dim() else (whole,)
    return pieces[rank] if rank < len(pieces) else whole.new_empty((0, *whole.shape[1:]))


def compare_gradients(
    a: list[dict], b: list[dict], rtol: float, rank: int = 0, world: int = 1, windows: int | None = None
) -> tuple[str, str]:
    """The gradients of run ``a``'s first ``windows`` windows (``GRADIENT_WINDOWS``; None: all) within ``rtol``
    of ``b``'s norm, over all parameters (``matrix_worker.Gradients``: under FSDP2 this rank's shards, compared
    with the same slices, ``rank`` of ``world``, of ``b``'s whole ones). Both runs must step as often. A window
    whose gradients overflowed (a GradScaler skip) must have overflowed in both runs."""
    if len(a) != len(b):
        return FAIL, f"gradients: {len(a)} windows against {len(b)}"
    worst, where = 0.0, ""
    count = GRADIENT_WINDOWS if windows is None else windows
    for w, (x, y) in enumerate(list(zip(a, b, strict=True))[:count]):
        if x.keys() != y.keys():
            return FAIL, f"gradients: window {w} has other parameters ({sorted(x.keys() ^ y.keys())[:2]})"
        overflowed = [not all(bool(torch.isfinite(t).all()) for t, _ in g.values()) for g in (x, y)]
        if any(overflowed):  # a GradScaler skip: in both runs, or a disagreement
            if not all(overflowed):
                return FAIL, f"gradients: window {w} overflowed in one run only"
            continue
        diff = ref = 0.0
        for name, (mine, sharded) in x.items():
            theirs = shard_of(y[name][0], rank, world) if sharded and world > 1 else y[name][0]
            if mine.shape != theirs.shape:
                return FAIL, f"gradients: {name} is {tuple(mine.shape)} against {tuple(theirs.shape)}"
            diff += float((mine.double() - theirs.double()).pow(2).sum())
            ref += float(theirs.double().pow(2).sum())
        ratio = math.sqrt(diff / ref) if ref > 0 else (0.0 if diff == 0 else math.inf)
        if ratio > worst:
            worst, where = ratio, f"gradients window {w} {ratio:.1e}"
    return (PASS if worst <= rtol else FAIL), where or "0"


def local_ranks_equal(
    two: list[dict], single: dict, start: dict, tol: tuple[float, float], per_rank: bool
) -> tuple[str, str]:
    """FSDP2's ``ranks equal``: each rank's own tensors, never gathered. Replicated ones (BatchNorm buffers,
    centres, anything unsharded) bit-identical between the ranks; each rank's shards of the state, optimiser
    state and first windows' gradients within ``tol`` of the same slices of the 1-process run (n.a. for objectives that differ per rank by
    design: their replicated tensors are still compared)."""
    world = len(two)
    locals_ = [r["full"]["local"] for r in two]
    replicated = [k for k, (_, sharded) in locals_[0]["state"].items() if not sharded]
    different = [
        k for k in replicated if not torch.equal(locals_[0]["state"][k][0], locals_[1]["state"][k][0])
    ]
    opt_diff = sum(
        not torch.equal(x[k][0], y[k][0])
        for x, y in zip(locals_[0]["optimizer"], locals_[1]["optimizer"], strict=True)
        for k in x if not x[k][1]
    )  # fmt: skip
    if different or opt_diff:
        return FAIL, f"replicated: {len(different)} tensors {different[:2]}, {opt_diff} optimiser tensors"
    if per_rank:
        return PASS, "replicated tensors only (the shards differ from 1 process by design)"
    whole_opt = single["optimizer"]
    for rank, local in enumerate(locals_):
        sharded = [k for k, (_, is_sharded) in local["state"].items() if is_sharded]
        mine = {"state": {k: local["state"][k][0] for k in sharded},
                "optimizer": [{k: v[0] for k, v in o.items() if v[1]} for o in local["optimizer"]]}  # fmt: skip
        ref = {"state": {k: shard_of(single["state"][k], rank, world) for k in sharded},
               "optimizer": [{k: shard_of(o[k], rank, world) for k, v in lo.items() if v[1]}
                             for lo, o in zip(local["optimizer"], whole_opt, strict=True)]}  # fmt: skip
        origin = {k: shard_of(start[k], rank, world) for k in sharded if k in start}
        status, detail = _compare_states(mine, ref, origin, tol[0])
        if status == FAIL:
            return FAIL, f"rank {rank}'s shards against 1 process: {detail}"
        grads = compare_gradients(two[rank]["full"]["gradients"], single["gradients"], tol[1], rank, world)
        if grads[0] == FAIL:
            return FAIL, f"rank {rank}'s shards against 1 process: {grads[1]}"
    return PASS, ""


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
    rtol = tolerance(row)
    start = one["initial"]["state"]
    full = [r["full"] for r in two] if two else []
    result: dict[str, tuple[str, str]] = {c: (NA, "1 process only") for c in COLUMNS}
    if two:
        if strategy(row) == "ddp":  # every rank holds whole tensors of its own
            result["ranks equal"] = _identical(full[0], full[1])
        else:
            result["ranks equal"] = local_ranks_equal(
                two, one["single"], start, rtol, per_rank(row) is not None
            )
        if per_rank(row) is not None:
            result["2 proc = 1 proc"] = (NA, per_rank(row))
        else:
            world = 1 if strategy(row) == "ddp" else len(full)  # FSDP2: rank 0's gradient shards
            result["2 proc = 1 proc"] = compare(full[0], one["single"], start, rtol, world=world)
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
    why_not = readable_copy(row)
    if why_not is not None:
        result["skipped = readable mean"] = (NA, why_not)
    else:  # BatchNorm's running statistics saw the copied micro-batch; training uses batch statistics
        result["skipped = readable mean"] = compare(
            one["single"], one["readable"], start, rtol, exclude=("bn buffers",)
        )
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
    """Each run started from ``start`` (the row's initial state: ``init_from``'s SOURCE loaded, its teacher as
    the student too under ``init_from_ema``), bit for bit; then finite, the expected step counts, and moved."""
    steps, skipped = expected_steps(row, windows)
    for run in runs:
        if run.get("start") is not None:
            if not any(k in run["start"] for k in groups(start).get("student", [])):
                return FAIL, "started elsewhere: none of the student's keys"
            elsewhere = [k for k in start if k in run["start"] and not torch.equal(run["start"][k], start[k])]
            if elsewhere:
                return FAIL, f"started elsewhere: {len(elsewhere)} tensors {elsewhere[:2]}"
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


def same_runs(mutated: Path, plain: Path) -> str:
    """Whether a row's runs under ``mutated`` equal those under ``plain`` bit for bit (state, optimiser state,
    every window's gradients, the resumed run): "bit-identical to the unmutated row", or "FAIL ..."."""
    for name in ("ws2_rank0.pt", "ws2_rank1.pt", "ws1_rank0.pt"):
        a, b = (torch.load(f / name, weights_only=False) for f in (mutated, plain))
        for run in b:
            if run == "initial" or not isinstance(b[run], dict) or "state" not in b[run]:
                continue
            status, detail = _identical(a[run], b[run])
            grads = compare_gradients(
                a[run]["gradients"], b[run]["gradients"], 0.0, windows=len(b[run]["gradients"])
            )
            if status == FAIL or grads[0] == FAIL:
                return f"FAIL: {name} {run}: {detail or grads[1]}"
    return "bit-identical to the unmutated row"


def header(axes: list[str]) -> list[str]:
    """The table's first two Markdown lines: the axes, then one column per check the code runs."""
    head = [*axes, *COLUMNS]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def table(rows: list[dict[str, str]], results: list[dict[str, tuple[str, str]]], axes: list[str]) -> str:
    """A Markdown table: one row per combination, one column per invariant (a FAIL shows its detail)."""
    from matrix_options import setting

    lines = header(axes)
    for row, result in zip(rows, results, strict=True):
        cells = [setting(row, a) for a in axes]
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
