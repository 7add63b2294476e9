"""Seeded defects of the kinds the invariant matrix exists for, and the rows that must kill them.

``python tests/invariants/matrix.py --mutants`` runs each mutant's row (``MUTANTS``) in every precision with the
defect applied in every process (``MATRIX_MUTANT``: ``matrix_worker.main`` calls :func:`apply`), and reports the
first failing cell of each: a mutant that no cell fails "survived", and the matrix has no teeth for it. A mutant
whose code path a precision never takes (no GradScaler outside ``16-mixed``) is run there too: its runs must
then equal the unmutated row's bit for bit ("equivalent"), which shows it is not a defect in that precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mutant:
    """A defect: what it breaks, the row (without its precision) that must catch it, and ``scaler_only`` when
    it lives in the GradScaler's path (equivalent in 32-true and bf16-mixed)."""

    what: str
    row: dict[str, str]
    patch: Callable[[], None]
    scaler_only: bool = False


_VIT = {"norm": "vit_nobn", "objective": "dino", "compile": "off"}


def _row(accumulate: str, unreadable: str, optimizer: str = "foreach", **more: str) -> dict[str, str]:
    return {"accumulate": accumulate, "unreadable": unreadable, "precision": "", "optimizer": optimizer,
            **_VIT, **more}  # fmt: skip


# ------------------------------------------------------------------------------------------------- patches
def _reduce_divisor() -> None:
    from ssl_xcit.dino import optimizer_step

    reduce = optimizer_step.reduce_local_gradients
    optimizer_step.reduce_local_gradients = lambda params, world_size, *a, **k: reduce(params, 1, *a, **k)


def _no_reduction() -> None:
    from ssl_xcit.dino import optimizer_step

    optimizer_step.reduce_local_gradients = lambda params, world_size, *a, **k: None


def _clip_before_unscale() -> None:
    """The clip moves to the window's start: before the gradients are the readable micro-batches' mean and
    before the GradScaler's unscale, so it sees neither true units nor the step's gradients."""
    from ssl_xcit.dino import optimizer_step
    from ssl_xcit.dino.optim import clip_gradients

    mean = optimizer_step.mean_over_readable
    module_of: dict[str, object] = {}

    def clip_first(params, readable, length):
        module = module_of["module"]
        if module.hparams.clip_grad:
            clip_gradients(module.student, module.hparams.clip_grad)
        mean(params, readable, length)

    def before(module, optimizer):  # the clip already ran
        optimizer_step.cancel_gradients_last_layer(module.current_epoch, module.student,
                                                   module.hparams.freeze_last_layer)  # fmt: skip
        optimizer_step.drop_backbone_gradients(module.student, module.global_step,
                                               optimizer_step.head_warmup_steps(module))  # fmt: skip

    window_step = optimizer_step.window_step

    def remember(module, *args, **kwargs):
        module_of["module"] = module
        return window_step(module, *args, **kwargs)

    optimizer_step.mean_over_readable = clip_first
    optimizer_step.before_optimizer_step = before
    from ssl_xcit.dino import module as dino_module

    dino_module.window_step = remember
    dino_module.before_optimizer_step = before


def _ema_one_rank() -> None:
    import torch.distributed as dist

    from ssl_xcit.dino import module as dino_module

    ema = dino_module.ema_update

    def rank_zero_only(teacher, student, momentum):
        # The other ranks run the same code with momentum 1 (teacher <- teacher): their teacher does not move,
        # and their collectives stay in step (under FSDP2 the EMA reshards the teacher; skipping it would end
        # the run in a collective mismatch instead of testing the checks).
        first = not dist.is_initialized() or dist.get_rank() == 0
        ema(teacher, student, momentum if first else 1.0)

    dino_module.ema_update = rank_zero_only


def _bn_unsynced() -> None:
    from ssl_xcit.dino import lifecycle

    lifecycle.convert_sync_batchnorm = lambda module: module


def _scheduler_per_micro_batch() -> None:
    """The schedules advance with every micro-batch (``Schedules.at`` indexed by micro-batches seen)."""
    from ssl_xcit.dino.schedules import Schedules

    at = Schedules.at
    seen: dict[str, object] = {"schedules": None, "count": 0}  # the run's schedules, held (ids are reused)

    def per_micro_batch(self, step):  # noqa: ARG001 (the optimiser step it ignores)
        if seen["schedules"] is not self:  # a new fit
            seen.update(schedules=self, count=0)
        index = seen["count"]
        seen["count"] = index + 1
        return at(self, index)  # ``at`` keeps the final values past the end

    Schedules.at = per_micro_batch


def _found_inf_ignored() -> None:
    """GradScaler never sees an inf or NaN: the step applies overflowed gradients and the scale never backs
    off."""
    unscale = torch.amp.GradScaler._unscale_grads_

    def ignore(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = unscale(self, optimizer, inv_scale, found_inf, allow_fp16)
        for value in found.values():
            value.zero_()
        return found

    torch.amp.GradScaler._unscale_grads_ = ignore


def _skipped_window_counted() -> None:
    """A window whose every micro-batch was skipped still steps (an optimiser step, the EMA, the step count)."""
    from ssl_xcit.dino import module as dino_module
    from ssl_xcit.dino import optimizer_step

    window_step = optimizer_step.window_step

    def counted(module, opt, momentum, reduce, readable):
        if all(p.grad is None for p in module.student.parameters()):
            opt.step()
            opt.zero_grad(set_to_none=True)
            module._update_teacher(momentum)
            return
        window_step(module, opt, momentum, reduce, readable)

    dino_module.window_step = counted


def _resume_off_by_one() -> None:
    """A resumed loader starts one batch late."""
    from ssl_xcit.data.resumable import ResumableSampler

    load = ResumableSampler.load_state_dict

    def late(self, state_dict):
        from matrix_worker import MICRO

        load(self, {**state_dict, "yielded": state_dict.get("yielded", 0) + MICRO})

    ResumableSampler.load_state_dict = late


def _readable_ignored() -> None:
    """The window's gradient is the readable micro-batches' sum / k (the behaviour before issue 50)."""
    from ssl_xcit.dino import optimizer_step

    optimizer_step.mean_over_readable = lambda params, readable, length: None


def _init_from_ema_ignored() -> None:
    """``init_from_ema`` leaves the student at SOURCE's student (its teacher is not copied in)."""
    from ssl_xcit.dino import init_from

    init_from._from_ema = lambda module, weights: weights


def _koleo_group_ignored() -> None:
    """KoLeo ignores ``koleo_group_size``: each rank's batch is spread on its own (DINOv2's per-rank KoLeo)."""
    from ssl_xcit.dino import step
    from ssl_xcit.dino.koleo import koleo_loss

    step.grouped_koleo_loss = lambda view, group_size: koleo_loss(view)


MUTANTS: dict[str, Mutant] = {
    "reduce_divisor": Mutant(
        "the window's explicit cross-rank reduction sums instead of averaging (that window's gradient doubled)",
        _row("2", "one_rank"), _reduce_divisor,
    ),
    "no_reduction": Mutant(
        "no cross-rank reduction of a window whose closing micro-batch every rank skipped",
        _row("2", "one_rank"), _no_reduction,
    ),
    "clip_before_unscale": Mutant(
        "the clip runs before the gradients are in true units (unscaled, the readable micro-batches' mean)",
        _row("2", "start"), _clip_before_unscale,
    ),
    "ema_one_rank": Mutant("the teacher's EMA runs on rank 0 only", _row("1", "none"), _ema_one_rank),
    "bn_unsynced": Mutant(
        "XCiT's BatchNorm statistics are not synchronised over the ranks",
        {**_row("1", "none"), "norm": "xcit_syncbn"}, _bn_unsynced,
    ),
    "scheduler_per_micro_batch": Mutant(
        "the lr, weight-decay and momentum schedules step per micro-batch", _row("2", "none"),
        _scheduler_per_micro_batch,
    ),
    "found_inf_ignored": Mutant(
        "GradScaler's found_inf is ignored: overflowed steps apply", _row("1", "none", scaler="overflow"),
        _found_inf_ignored, scaler_only=True,
    ),
    "skipped_window_counted": Mutant(
        "a window whose every micro-batch was skipped counts as an optimiser step", _row("2", "every_rank"),
        _skipped_window_counted,
    ),
    "resume_off_by_one": Mutant(
        "a resumed run's data position is one batch late", _row("1", "none"), _resume_off_by_one,
    ),
    "readable_ignored": Mutant(
        "a window with a skipped micro-batch steps on the readable gradients' sum / k, not their mean",
        _row("2", "start"), _readable_ignored,
    ),
    # The rows of matrix_options.OPTIM_ROWS that hold the option (their 32-true and bf16-mixed cells).
    "init_from_ema_ignored": Mutant(
        "`init_from_ema` starts the student from SOURCE's student, not its teacher",
        _row("2", "none", objective="init_from", optim="init_from_ema"), _init_from_ema_ignored,
    ),
    "koleo_group_ignored": Mutant(
        "KoLeo ignores `koleo_group_size`: each rank's batch is spread on its own",
        _row("2", "one_rank", objective="koleo", optim="koleo_group"), _koleo_group_ignored,
    ),
}  # fmt: skip

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


def rows(name: str) -> list[dict[str, str]]:
    """The mutant's row in every precision (``scaler`` only where the precision has a GradScaler)."""
    found = []
    for precision in PRECISIONS:
        row = {**MUTANTS[name].row, "precision": precision}
        if precision != "16-mixed":
            row.pop("scaler", None)
        found.append(row)
    return found


def apply(name: str) -> None:
    """Seed mutant ``name`` into this process (``MUTANTS``)."""
    if name not in MUTANTS:
        raise SystemExit(f"unknown mutant {name!r}; valid: {', '.join(MUTANTS)}")
    MUTANTS[name].patch()


@contextlib.contextmanager
def environment(name: str):
    """``MATRIX_MUTANT`` set to ``name`` for the processes started inside."""
    import os

    old = os.environ.get("MATRIX_MUTANT")
    os.environ["MATRIX_MUTANT"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MATRIX_MUTANT", None)
        else:
            os.environ["MATRIX_MUTANT"] = old
