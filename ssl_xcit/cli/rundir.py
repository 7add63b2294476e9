"""One folder per run: ``<root>/version_<N>`` holds the run's logs and checkpoints together.

``root`` is ``--trainer.default_root_dir`` (``runs/<recipe>`` in the recipes), so moving it moves everything;
``--run_dir DIR`` names the folder outright. Recipes give no logger ``save_dir`` and no checkpoint ``dirpath``:
:func:`place_run` fills them in before the classes are built, so two runs never share a checkpoint folder and
``--ckpt_path last`` resolves to the newest run of that root, never to a file another run wrote.

Under DDP the launching process picks the folder and hands it to the processes Lightning starts through
``SSL_XCIT_RUN_DIR``; with an external launcher (torchrun, SLURM) pass ``--run_dir`` so every rank agrees.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ssl_xcit.utils.io import make_private_dir

RUN_DIR_ENV = "SSL_XCIT_RUN_DIR"
LAST = "last.ckpt"
_VERSION = re.compile(r"^version_(\d+)$")
# Loggers whose folder we place (the two the recipes use); any other logger keeps its own arguments.
_PLACED_LOGGERS = (
    "lightning.pytorch.loggers.TensorBoardLogger",
    "lightning.pytorch.loggers.tensorboard.TensorBoardLogger",
    "lightning.pytorch.loggers.CSVLogger",
    "lightning.pytorch.loggers.csv_logs.CSVLogger",
)
_CHECKPOINT = (
    "lightning.pytorch.callbacks.ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
)


def versions(root: Path) -> dict[int, Path]:
    """``{N: root/version_N}`` for the run folders under ``root``."""
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        match = _VERSION.match(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return found


def new_run_dir(root: Path) -> Path:
    """Create and return the next free ``root/version_N`` (created now, so a parallel run cannot take it)."""
    root.mkdir(parents=True, exist_ok=True)
    number = max(versions(root), default=-1) + 1
    while True:
        path = root / f"version_{number}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            number += 1


def latest_resumable(root: Path) -> Path | None:
    """The highest-numbered run under ``root`` that has ``checkpoints/last.ckpt``, or None."""
    for number in sorted(versions(root), reverse=True):
        run = root / f"version_{number}"
        if (run / "checkpoints" / LAST).is_file():
            return run
    return None


def as_list(value: Any) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _init_args(entry: Any) -> Any | None:
    return getattr(entry, "init_args", None) if hasattr(entry, "class_path") else None


def place_run(
    config: Any, subcommand: str, run_dir: str | None, child_run_dir: str | None = None
) -> tuple[Path, str | None]:
    """Choose the run folder for ``config`` (one subcommand's jsonargparse namespace) and point the loggers,
    checkpoint callbacks and ``default_root_dir`` into it. Returns ``(run folder, message or None)``.

    ``ckpt_path: last`` becomes the chosen run's ``checkpoints/last.ckpt``: for ``fit`` that run is resumed in
    place; for ``validate``/``test``/``predict`` its logs go to a ``<subcommand>/`` subfolder of the run.
    """
    trainer = config.trainer
    root = Path(trainer.default_root_dir or "runs").expanduser()
    ckpt_path = getattr(config, "ckpt_path", None)
    message = None
    if child_run_dir:  # a DDP process started by Lightning: the launcher already chose
        run = Path(child_run_dir)
    elif run_dir:
        run = Path(run_dir).expanduser()
        run.mkdir(parents=True, exist_ok=True)
    elif ckpt_path == "last":
        run = latest_resumable(root)
        if run is None:
            if subcommand != "fit":
                raise FileNotFoundError(
                    f"--ckpt_path last: no run under {root} has checkpoints/{LAST}; "
                    f"train one first or give the checkpoint's path"
                )
            run = new_run_dir(root)
            message = f"--ckpt_path last: no earlier run under {root} to resume; starting a new run"
    elif ckpt_path and Path(ckpt_path).parent.name == "checkpoints" and subcommand != "fit":
        run = Path(ckpt_path).parent.parent  # evaluating a run's checkpoint: its logs join that run
    else:
        run = new_run_dir(root)
    if ckpt_path == "last" and message is None:
        config.ckpt_path = str(run / "checkpoints" / LAST)
        verb = "resuming" if subcommand == "fit" else "evaluating"
        message = f"--ckpt_path last: {verb} {run} from {config.ckpt_path}"
    elif message is not None:
        config.ckpt_path = None

    log_dir = run if subcommand == "fit" else run / subcommand
    trainer.default_root_dir = str(run)
    for entry in as_list(trainer.logger):
        args = _init_args(entry)
        if args is not None and entry.class_path in _PLACED_LOGGERS:
            # Lightning numbers the sessions inside (csv/version_0, then version_1 after a resume), so a
            # resumed run never deletes the first session's metrics.csv.
            args.save_dir = str(log_dir)
    for entry in as_list(trainer.callbacks):
        args = _init_args(entry)
        if args is not None and entry.class_path in _CHECKPOINT and getattr(args, "dirpath", None) is None:
            args.dirpath = str(run / "checkpoints")
    make_private_dir(run / "checkpoints")
    return run, message
