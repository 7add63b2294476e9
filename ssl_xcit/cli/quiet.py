"""Quiet console output: drop the lines that tell a user nothing about their run, keep every true warning.

Silenced: Lightning's product tips (litlogger, litmodels) and its "already configured with model summary"
note, the ``LeafSpec`` deprecation that Lightning's own pytree helper triggers under torch >= 2.10 on every
command, and the FLOPs column and "Total Flops: 0" of the model summary (Lightning counts FLOPs only for a
model that defines ``example_input_array``; ours cannot, crops vary). ``num_workers`` above the usable cores
is lowered to them with one line.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)

_NOISE = ("💡 Tip:", "Trainer already configured with model summary callbacks")
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(_NOISE)


_FILTER = _DropNoise()


def install_filters() -> None:
    """Install the logging filters (idempotent) and the warning filter (inside the caller's
    ``warnings.catch_warnings`` block, if any)."""
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    # Raised inside lightning/pytorch/utilities/_pytree.py, not by our code; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    # ModelCheckpoint(every_n_train_steps) under manual optimisation (DINO's) says the checkpoint holds the weights
    # after the step, which is what a step checkpoint should hold (the resume continues from there).
    warnings.filterwarnings(
        "ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train"
    )
    # torchdata's StatefulDataLoader (the training loader) calls a deprecated torch function when it is built.
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated")


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's or a SLURM job's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cap_workers(requested: int, what: str = "data.num_workers") -> int:
    """``requested`` DataLoader workers, lowered to the usable cores with one line saying so."""
    cores = available_cores()
    if requested <= cores:
        return requested
    rank_zero_info(f"{what}: {requested} workers requested, {cores} CPU cores available; using {cores}")
    return cores


class CompactModelSummary(ModelSummary):
    """Lightning's model summary without the FLOPs column and the "Total Flops" line (always 0 for DINO)."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        columns = [(name, [str(v) for v in values]) for name, values in summary_data if name != "FLOPs"]
        widths = [max([len(name), *map(len, values)]) for name, values in columns]
        rows = [" | ".join(name.ljust(w) for (name, _), w in zip(columns, widths, strict=True))]
        rows.append("-" * len(rows[0]))
        for i in range(len(columns[0][1]) if columns else 0):
            rows.append(
                " | ".join(values[i].ljust(w) for (_, values), w in zip(columns, widths, strict=True))
            )
        rows.append("-" * len(rows[0]))
        frozen = total_parameters - trainable_parameters
        rows += [
            f"{get_human_readable_count(trainable_parameters):<10}Trainable params",
            f"{get_human_readable_count(frozen):<10}Non-trainable params",
            f"{get_formatted_model_size(model_size):<10}Total estimated model params size (MB)",
        ]
        rank_zero_info("\n" + "\n".join(rows))
