"""``ssl-xcit fit|validate -c CONFIG.yaml``: LightningCLI over any LightningModule/DataModule.

Subclass mode: a config names its model and data classes (``class_path``), so the DINO recipes
(``ssl_xcit.dino.module.DINO`` + ``ssl_xcit.data.DINODataModule``) and the linear-probe configs of
``eval/`` run through the same command. Every key is checked by jsonargparse: a typo is an error that names it
and suggests the closest valid key.

What :class:`SSLXCiTCLI` adds to LightningCLI: one folder per run (``ssl_xcit.cli.rundir``: logs and
checkpoints together, ``--run_dir``, ``--ckpt_path last`` naming the run it resumes), ``num_workers`` capped to
the usable cores, quiet output (``ssl_xcit.cli.quiet``), a checkpoint and a clean stop on SIGTERM or SLURM's
SIGUSR1 (``ssl_xcit.trainer.preemption``) and, after ``fit``, where everything is.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import ssl_xcit.parallel.fsdp  # noqa: F401 - registers --trainer.strategy fsdp2 and fsdp2_whole
from ssl_xcit.cli.errors import ShortErrorParser
from ssl_xcit.cli.quiet import cap_workers, install_filters
from ssl_xcit.cli.rundir import RUN_DIR_ENV, as_list, inherited_run_dir, place_run
from ssl_xcit.models.sharded import is_checkpoint
from ssl_xcit.parallel.meta_start import is_fsdp2_setting, meta_start

PREEMPTION = "ssl_xcit.trainer.preemption.PreemptionCheckpoint"


class SSLXCiTCLI(LightningCLI):
    """LightningCLI with per-run folders, short parse errors with suggestions, capped workers and an end-of-fit
    summary (see the module docstring)."""

    run_dir: Path | None = None
    _announcement: str | None = None
    resuming = False

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help="Folder of this run's logs and checkpoints (default: a new <trainer.default_root_dir>/version_N, "
            "or the resumed one with --ckpt_path last)",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        child = inherited_run_dir()
        self.run_dir, message = place_run(config, self.subcommand or "fit", config.get("run_dir"), child)
        os.environ[RUN_DIR_ENV] = str(self.run_dir)
        self.resuming = config.get("ckpt_path") == str(self.run_dir / "checkpoints" / "last.ckpt")
        # Said when the run starts, so a bad input fails with its error alone.
        self._announcement = None if child is not None else (message or f"run folder: {self.run_dir}")
        data_args = getattr(config.get("data"), "init_args", None)
        if data_args is not None and isinstance(getattr(data_args, "num_workers", None), int):
            data_args.num_workers = cap_workers(data_args.num_workers)
        callbacks = as_list(config.trainer.callbacks)
        if config.trainer.enable_model_summary is not False and not any(
            "ModelSummary" in str(getattr(cb, "class_path", "")) for cb in callbacks
        ):  # our summary instead of Lightning's default one (no FLOPs column, always 0 here)
            summary = Namespace(class_path="ssl_xcit.cli.quiet.CompactModelSummary", init_args=Namespace())
            callbacks.append(summary)
            config.trainer.callbacks = callbacks
        if self.subcommand == "fit" and not any(
            str(getattr(cb, "class_path", "")).endswith("PreemptionCheckpoint") for cb in callbacks
        ):  # SIGTERM / SLURM's SIGUSR1 save a checkpoint and stop (docs/cluster.md)
            callbacks.append(Namespace(class_path=PREEMPTION, init_args=Namespace(requeue=True)))
            config.trainer.callbacks = callbacks
        for callback in callbacks:
            args = getattr(callback, "init_args", None)
            if args is not None and isinstance(getattr(args, "num_workers", None), int):
                name = str(getattr(callback, "class_path", "callback")).rsplit(".", 1)[-1]
                args.num_workers = cap_workers(args.num_workers, f"{name}.num_workers")

    def instantiate_classes(self) -> None:
        # Under FSDP2 the model's networks start on the meta device (ssl_xcit.parallel.meta_start).
        config = self.config[self.subcommand] if self.subcommand else self.config
        with meta_start(is_fsdp2_setting(config.trainer.get("strategy"))):
            super().instantiate_classes()

    def _announce(self) -> None:
        if self._announcement:
            rank_zero_info(self._announcement)

    before_predict = _announce

    def _metrics_table_instead(self) -> None:
        # Lightning's results table prints float32 values in full (0.07000000029802322); ours rounds them.
        self._announce()
        if self.config_init[self.subcommand].get("verbose", True):
            self.config_init[self.subcommand]["verbose"] = False
            self._print_metrics = True

    before_validate = before_test = _metrics_table_instead

    def _print_metrics_table(self) -> None:
        if getattr(self, "_print_metrics", False) and self.trainer.is_global_zero:
            print(metrics_table(self.trainer.callback_metrics, f"{self.subcommand} metrics"))

    after_validate = after_test = _print_metrics_table

    def before_fit(self) -> None:
        self._announce()
        if type(self.model).__name__ in ("LinearProbe", "Distill"):
            # Its backbone (a distillation's teacher) is frozen in eval mode on purpose; the notice is kept for every other model (a DINO
            # student or teacher in eval mode at the start of training is a real problem).
            warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
        if self.resuming:  # the resumed run's own folder: its checkpoints are meant to be there
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(fit_summary(self.trainer, self.run_dir))


def metrics_table(metrics: dict[str, Any], title: str) -> str:
    """``name  value`` rows, values to 4 significant digits (float32 noise hidden), sorted by name."""
    if not metrics:
        return f"{title}: none logged"
    width = max(len(name) for name in metrics)
    rows = [f"{name:<{width}}  {float(value):.4g}" for name, value in sorted(metrics.items())]
    return "\n".join([title, *rows])


def _short(path: Path) -> str:
    """``path`` relative to the working directory when it lies inside it (Lightning makes dirpaths absolute)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def fit_summary(trainer: Any, run_dir: Path | None) -> str:
    """Where a finished fit left things: run folder, checkpoints, final k-NN, next commands."""
    last, kept = None, []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.dirpath:
            continue
        folder = Path(callback.dirpath)
        if is_checkpoint(folder / "last.ckpt"):
            last = folder / "last.ckpt"
        kept = sorted(p for p in folder.glob("*.ckpt") if p.name != "last.ckpt")
    lines = [f"run folder: {_short(run_dir)}" if run_dir else "run folder: none (no run folder was set)"]
    if last is not None:
        last = Path(_short(last))
        lines.append(f"last checkpoint: {last}")
    if kept:
        lines.append(f"kept checkpoints: {', '.join(p.name for p in kept)}")
    knn = next((cb for cb in trainer.callbacks if type(cb).__name__ == "OnlineKNN"), None)
    if knn is not None and knn.history:
        final = knn.history[-1]
        lines.append(
            f"final online k-NN top-1: {final['top1']:.2f}% (k={knn.k}, T={knn.temperature:g}, "
            f"epoch {final['epoch']}, step {final['step']})"
        )
    if last is not None:
        network = getattr(trainer.lightning_module, "evaluated_network", "teacher")  # a distillation: student
        weights = Path(run_dir or last.parent.parent) / f"{network}.safetensors"
        lines.append(
            f"next: ssl-xcit export {shlex.quote(str(last))} {shlex.quote(str(weights))}\n"
            f"      ssl-xcit knn --weights {shlex.quote(str(weights))} --train DIR --val DIR"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> LightningCLI:
    """Run the CLI on ``argv`` (the subcommand first, e.g. ``["fit", "-c", "recipes/quickstart.yaml"]``;
    default ``sys.argv[1:]``) and return it; ``cli.trainer`` and ``cli.model`` hold the results."""
    if os.environ.get("LOCAL_RANK", "0") == "0":  # a DDP child keeps the folder its launcher chose
        os.environ.pop(RUN_DIR_ENV, None)
    try:
        with warnings.catch_warnings():
            install_filters()
            # The dispatcher passes argv explicitly (it equals sys.argv[1:] from the console); not a mistake here.
            warnings.filterwarnings(
                "ignore", message=".*not recommended to provide both args and command line"
            )
            return SSLXCiTCLI(
                LightningModule,
                LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                seed_everything_default=0,
                save_config_kwargs={"overwrite": True},
                args=None if argv is None else list(argv),
                parser_class=ShortErrorParser,
                run=True,
            )
    except BaseException:
        _remove_if_empty(os.environ.get(RUN_DIR_ENV))
        raise


def _remove_if_empty(run_dir: str | None) -> None:
    """A run that never started (bad data path, unknown model) leaves no empty version folder behind."""
    if not run_dir or not re.fullmatch(r"version_\d+", Path(run_dir).name):  # only folders we numbered
        return
    if Path(run_dir).is_dir() and not any(p.is_file() for p in Path(run_dir).rglob("*")):
        shutil.rmtree(run_dir, ignore_errors=True)
