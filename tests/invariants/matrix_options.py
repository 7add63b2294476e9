"""The option axes of the invariant matrix and its all-pairs design.

``AXES`` is the whole option space of DDP, one line per axis (a new axis or value is one line);
``pairwise(AXES)`` picks the rows, deterministically, so that every pair of values of two axes runs together in
at least one row. A row is a ``dict`` axis -> value; its ``row_id`` names it. The ``strategy`` axis (FSDP2) has a
design of its own (``FSDP2_AXES``): its rows carry a ``strategy`` key, DDP's rows none (so their ids stay).
"""

from __future__ import annotations

from itertools import combinations

AXES: dict[str, tuple[str, ...]] = {
    "accumulate": ("1", "2", "3"),
    # Where the unreadable micro-batch is (window 1 of 4): on every rank at the window's first or last
    # micro-batch; on rank 1 only at the window's last (the ranks must agree to skip); every micro-batch of
    # the window on every rank (no optimiser step in that window).
    "unreadable": ("none", "start", "end", "one_rank", "every_rank"),
    "precision": ("32-true", "bf16-mixed", "16-mixed"),
    # SGD: fused=False leaves torch its own choice (foreach on accelerators, the for-loop on the CPU), or fused.
    # adamw: what users run (matrix_worker.OPTIMIZERS): AdamW with the quickstart recipe's schedules, DINO's
    # one-epoch last-layer freeze and the automatic fused choice (fused under 16-mixed's GradScaler).
    "optimizer": ("foreach", "fused", "adamw"),
    "norm": ("xcit_syncbn", "vit_nobn"),
    "objective": ("dino", "koleo", "ibot", "gram", "distill_features", "distill_dino", "init_from"),
    "compile": ("off", "aot_eager"),
}


# Keys a row may carry besides AXES, with the value a row without the key has: the GradScaler's start (``low``:
# 2^4, no overflow; ``overflow``: torch's default 2^16, which overflows the first step, matrix_worker.SCALERS),
# compile with ``inductor`` (extra rows only: minutes of compile on 2 cores), the strategy (FSDP2's rows), the
# model's optimisation and objective options (``optim``: matrix_worker.OPTIMS) and the FSDP2 strategy's
# ``reshard_after_forward`` for the student's blocks (``reshard``: ``after_forward``, FSDP2's default, or ``kept``:
# false, kept gathered through the backward; an int needs a shard group of more than 2 ranks).
EXTRA_KEYS = {"scaler": "low", "strategy": "ddp", "optim": "dino", "reshard": "after_forward"}


def row_id(row: dict[str, str]) -> str:
    """A short stable name: the values in axis order (``2-end-16-mixed-fused-...``)."""
    return "-".join(row[axis] for axis in row)


def setting(row: dict[str, str], key: str) -> str:
    """``row``'s value of an axis or of an ``EXTRA_KEYS`` key (its default when the row has none)."""
    return row.get(key, EXTRA_KEYS.get(key))


def _uncovered(axes: dict[str, tuple[str, ...]]) -> set[tuple[str, str, str, str]]:
    return {(a, va, b, vb) for a, b in combinations(axes, 2) for va in axes[a] for vb in axes[b]}


def _pairs(row: dict[str, str], axes: dict[str, tuple[str, ...]]) -> set[tuple[str, str, str, str]]:
    set_axes = [a for a in axes if a in row]
    return {(a, row[a], b, row[b]) for a, b in combinations(set_axes, 2)}


def pairwise(axes: dict[str, tuple[str, ...]] = AXES) -> list[dict[str, str]]:
    """A covering array of strength 2, greedy and deterministic: each row starts from the first still
    uncovered pair (in axis and value order) and fills every other axis with the value that covers the
    most uncovered pairs with the values already chosen (ties: the value listed first). Small enough here
    (about 40 rows for 7 axes of up to 7 values, against 2,520 in the full product) and no dependency."""
    todo = _uncovered(axes)
    order = list(axes)
    rows: list[dict[str, str]] = []
    while todo:
        a, va, b, vb = min(todo, key=lambda p: (order.index(p[0]), axes[p[0]].index(p[1]),
                                                 order.index(p[2]), axes[p[2]].index(p[3])))  # fmt: skip
        row = {a: va, b: vb}
        for axis in order:
            if axis in row:
                continue
            row[axis] = max(
                axes[axis],
                key=lambda v: (len(_pairs({**row, axis: v}, axes) & todo), -axes[axis].index(v)),
            )
        row = {axis: row[axis] for axis in order}
        todo -= _pairs(row, axes)
        rows.append(row)
    return rows


# Rows added to the all-pairs design so that "accumulation = concatenation" is checked in every precision and for
# every objective whose loss does not depend on the batch split: no all-pairs row has accumulation > 1, no
# unreadable micro-batch, the ViT and such an objective at once.
_ACC = {"unreadable": "none", "norm": "vit_nobn", "compile": "off"}
ACCUMULATION_ROWS = [
    {"accumulate": "2", **_ACC, "precision": p, "optimizer": "foreach", "objective": "dino"}
    for p in AXES["precision"]
] + [
    {"accumulate": k, **_ACC, "precision": p, "optimizer": o, "objective": objective}
    for k, p, o, objective in (
        ("3", "32-true", "adamw", "gram"),
        ("2", "bf16-mixed", "foreach", "distill_features"),
        ("3", "16-mixed", "fused", "distill_dino"),
        ("2", "32-true", "foreach", "init_from"),
        ("2", "bf16-mixed", "adamw", "dino"),
    )
]
for _row in ACCUMULATION_ROWS:  # axis order, so ids read as the design's
    _row.update({a: _row.pop(a) for a in list(AXES)})
# What users run that the all-pairs design cannot hold: GradScaler overflow steps (torch's default first scale,
# 2^16, overflows the first step in every batch split; ``matrix_worker.SCALERS``), and inductor, the compile
# backend users get (aot_eager's graphs without inductor's kernels in the design's rows).
USER_ROWS = [
    {"accumulate": "1", "unreadable": "none", "precision": "16-mixed", "optimizer": "foreach",
     "norm": "vit_nobn", "objective": "dino", "compile": "off", "scaler": "overflow"},
    {"accumulate": "2", "unreadable": "one_rank", "precision": "16-mixed", "optimizer": "adamw",
     "norm": "vit_nobn", "objective": "dino", "compile": "off", "scaler": "overflow"},
    {"accumulate": "1", "unreadable": "none", "precision": "32-true", "optimizer": "adamw",
     "norm": "vit_nobn", "objective": "dino", "compile": "inductor"},
]  # fmt: skip


# DINOv3's optimisation options (``optim``: ``dinov3``, matrix_worker.OPTIMS: the clip per submodule, layer-wise lr
# decay, the patch embedding's multiplier, the sqrt lr rule, a constant teacher momentum, the local crops' weight
# on the Gram ramp, teachers in eval mode) on Gram anchoring, the objective they come with, under DDP and under
# FSDP2 (where the per-submodule clip must take the whole gradients' norm). SGD: a clip shows in its update,
# where AdamW's normalisation would hide it. Rows of their own, outside the designs whose tables the docs hold
# (test_matrix.py runs them).
OPTIM_ROWS = [
    {"accumulate": "2", "unreadable": "one_rank", "precision": "32-true", "optimizer": "foreach",
     "norm": "vit_nobn", "objective": "gram", "compile": "off", "optim": "dinov3"},
    {"accumulate": "1", "unreadable": "start", "precision": "bf16-mixed", "optimizer": "foreach",
     "norm": "xcit_syncbn", "objective": "ibot", "compile": "off", "optim": "dinov3"},
    {"accumulate": "2", "unreadable": "none", "precision": "32-true", "optimizer": "foreach",
     "norm": "vit_nobn", "objective": "gram", "compile": "off", "strategy": "fsdp2", "optim": "dinov3"},
]  # fmt: skip
# The newest options, each in 32-true and bf16-mixed: ``init_from_ema`` (the student starts from SOURCE's teacher;
# the ``finite, moved, steps`` column checks each run's start) and ``koleo_group_size`` 4 (one KoLeo group per
# global micro-batch, gathered across the 2 ranks: ``2 proc = 1 proc`` holds again) in pairs of rows that differ in
# precision only (a seeded defect's row, ``mutants.MUTANTS``, is the pair itself); distillation's
# ``teacher_to_student_resolution_scale`` 2 (32 px global crops, the student's downsampled to 16) with ``dino``
# under FSDP2 with the student's blocks kept gathered (``reshard``: ``kept``) in 32-true, ``features`` in bf16.
_NEW = {"unreadable": "none", "optimizer": "foreach", "norm": "vit_nobn", "compile": "off"}
OPTIM_ROWS += [
    {"accumulate": "2", **_NEW, "precision": p, "objective": "init_from", "optim": "init_from_ema"}
    for p in ("32-true", "bf16-mixed")
] + [
    {"accumulate": "2", **_NEW, "unreadable": "one_rank", "precision": p, "objective": "koleo",
     "optim": "koleo_group"}
    for p in ("32-true", "bf16-mixed")
] + [
    {"accumulate": "2", **_NEW, "precision": "32-true", "objective": "distill_dino", "strategy": "fsdp2",
     "optim": "teacher_to_student_2", "reshard": "kept"},
    {"accumulate": "2", **_NEW, "precision": "bf16-mixed", "objective": "distill_features",
     "optim": "teacher_to_student_2"},
]  # fmt: skip
for _row in OPTIM_ROWS:  # axis order, then the extra keys, so ids read as the design's
    _row.update({a: _row.pop(a) for a in [*AXES, *EXTRA_KEYS] if a in _row})


def design(axes: dict[str, tuple[str, ...]] = AXES) -> list[dict[str, str]]:
    """The DDP rows: the all-pairs design, then ``ACCUMULATION_ROWS`` and ``USER_ROWS`` (those of ``axes``'
    values)."""
    rows = pairwise(axes)
    known = lambda r: all(r[a] in axes[a] or a == "compile" for a in axes)  # noqa: E731
    extra = [r for r in ACCUMULATION_ROWS + USER_ROWS if known(r) and r not in rows]
    return rows + extra


STRATEGIES = ("ddp", "fsdp2", "fsdp2_whole")
# FSDP2 (``--trainer.strategy fsdp2``: sharded checkpoints; ``fsdp2_whole``: one-file checkpoints) over what it
# runs: 32-true and bf16-mixed (DINOv3's policy), torch's default SGD and the users' AdamW, no compile. The unreadable positions keep one window-closing
# case (rank 1 only: the ranks must agree) besides none, start and a window with no step; "end" takes the same
# path as "one_rank" (every rank skips the closing micro-batch). 28 rows (7 objectives x 4 positions).
FSDP2_AXES: dict[str, tuple[str, ...]] = {
    **AXES,
    "unreadable": ("none", "start", "one_rank", "every_rank"),
    "precision": ("32-true", "bf16-mixed"),
    "optimizer": ("foreach", "adamw"),
    "compile": ("off",),
    "strategy": STRATEGIES[1:],
}
# What FSDP2 refuses, each a row whose every run must end with this one-line error (matrix_checks.REFUSED):
# 16-mixed (its GradScaler would decide per shard whether a step overflowed; Lightning's own check sees only a
# strategy instance, not the registered name), compile (not supported under fsdp2 yet) and fused SGD (torch has
# no DTensor rule for its kernel; fused AdamW has one, but the matrix trains with SGD).
_BASE = {"accumulate": "1", "unreadable": "none", "precision": "32-true", "optimizer": "foreach",
         "norm": "vit_nobn", "objective": "dino", "compile": "off"}  # fmt: skip
REFUSALS: dict[str, tuple[dict[str, str], str]] = {
    "16-mixed": ({"precision": "16-mixed"}, "16-mixed is not supported under --trainer.strategy fsdp2"),
    "compile": ({"compile": "aot_eager"}, "compile is not supported under --trainer.strategy fsdp2"),
    "fused": (
        {"optimizer": "fused"},
        "torch has no fused sgd for sharded (--trainer.strategy fsdp2) parameters",
    ),
}
REFUSED_ROWS = [  # the two FSDP2 strategies in turn
    {**_BASE, **change, "strategy": STRATEGIES[1 + i % 2]} for i, (change, _) in enumerate(REFUSALS.values())
]


def strategy(row: dict[str, str]) -> str:
    """The row's strategy (DDP's rows carry none)."""
    return setting(row, "strategy")


def expected_refusal(row: dict[str, str]) -> str | None:
    """The start of the error ``row`` must end with, or None for a row that trains."""
    if strategy(row) == "ddp":
        return None
    return next(
        (text for change, text in REFUSALS.values() if all(row[a] == v for a, v in change.items())), None
    )


def fsdp2_design() -> list[dict[str, str]]:
    """The FSDP2 rows: the all-pairs design of ``FSDP2_AXES``, its accumulation rows (FSDP2's precisions,
    both checkpoint forms), then ``REFUSED_ROWS``."""
    rows = pairwise(FSDP2_AXES)
    precisions = FSDP2_AXES["precision"]
    extra = [{**r, "strategy": FSDP2_AXES["strategy"][precisions.index(r["precision"])]}
             for r in ACCUMULATION_ROWS[: len(AXES["precision"])] if r["precision"] in precisions]  # fmt: skip
    return rows + [r for r in extra if r not in rows] + REFUSED_ROWS


def full_design(strategies: tuple[str, ...] = STRATEGIES) -> list[dict[str, str]]:
    """Every row of the matrix whose strategy is in ``strategies``: DDP's design, then FSDP2's."""
    return [r for r in design(AXES) + fsdp2_design() if strategy(r) in strategies]


def covered(rows: list[dict[str, str]], axes: dict[str, tuple[str, ...]] = AXES) -> bool:
    """Whether ``rows`` hold every pair of values of every two axes."""
    found = set().union(*(_pairs(r, axes) for r in rows)) if rows else set()
    return _uncovered(axes) <= found


def accumulation_exact(row: dict[str, str]) -> str | None:
    """None when accumulating ``row``'s micro-batches must equal one step over their concatenation, else why
    not. Nothing may depend on the batch split: not BatchNorm's batch statistics (XCiT: 4 images vs 4k),
    KoLeo's neighbours or Sinkhorn-Knopp's equipartition over the batch, not iBOT's mask draws (seeded per
    micro-batch); and with an unreadable micro-batch the window's gradient is its readable micro-batches'
    sum / k, which no concatenated batch gives."""
    if row["accumulate"] == "1":
        return "k = 1"
    if row["unreadable"] != "none":
        return "unreadable"
    if row["norm"] == "xcit_syncbn":
        return "BatchNorm statistics"
    return {"koleo": "KoLeo, Sinkhorn-Knopp", "ibot": "iBOT masks, Sinkhorn-Knopp"}.get(row["objective"])
