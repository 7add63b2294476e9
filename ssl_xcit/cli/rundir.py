"""One folder per run: ``<root>/version_<N>`` holds the run's logs and checkpoints together.

``root`` is ``--trainer.default_root_dir`` (``runs/<recipe>`` in the recipes), so moving it moves everything;
``--run_dir DIR`` names the folder outright. Recipes give no logger ``save_dir`` and no checkpoint ``dirpath``:
:func:`place_run` fills them in before the classes are built, so two runs never share a checkpoint folder and
``--ckpt_path last`` resolves to the newest run of that root, never to a file another run wrote.

Every process of a run must use the same folder, and the folder is chosen before the process group exists:

- processes Lightning starts itself (``strategy: ddp`` from one command) get the launching process's choice
  through ``SSL_XCIT_RUN_DIR``;
- under torchrun (detected by ``TORCHELASTIC_RUN_ID``) global rank 0 chooses and the others read its choice
  from the launcher's own key-value store (the TCPStore torchrun serves at ``MASTER_ADDR:MASTER_PORT`` for
  its workers), on any number of nodes;
- under SLURM's ``srun`` (``SLURM_PROCID``, more than one task) rank 0 chooses and writes it to
  ``<root>/.launches/<job>.<step>.<restart>``, which the other tasks wait for: ``default_root_dir`` must be
  on a filesystem every node shares (as it must be for ``--ckpt_path``), or pass ``--run_dir``;
- under MPI (``OMPI_COMM_WORLD_*``, ``PMI_*``) and any other launcher that sets ``WORLD_SIZE > 1`` with
  ``RANK`` (Kubeflow, a user's own script) or ``NODE_RANK`` (one command per node, Lightning starting the
  rest), rank 0 writes its choice to a file under ``<root>/.launches`` named after what the launch's
  processes share: the MPI job (``PMIX_NAMESPACE``, ``OMPI_MCA_ess_base_jobid``) or ``MASTER_ADDR:MASTER_PORT``.
  Such a name comes back at the next launch with the same address, so a choice is read only through a
  handshake: every rank acknowledges the claim's nonce, rank 0 then marks it done and removes the claim, and
  a rank that read a leftover claim sees it replaced and reads the new one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsspec.utils import get_protocol

from ssl_xcit.cli.launchers import Launcher, _safe_name, agree, detect_launcher, scheduler_launcher
from ssl_xcit.errors import UserError
from ssl_xcit.models.sharded import is_checkpoint
from ssl_xcit.utils.io import make_dir, owner_only

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
__all__ = ["Launcher", "detect_launcher", "inherited_run_dir", "place_run"]
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
        if is_checkpoint(run / "checkpoints" / LAST):
            return run
    return None


def as_list(value: Any) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _init_args(entry: Any) -> Any | None:
    return getattr(entry, "init_args", None) if hasattr(entry, "class_path") else None


def inherited_run_dir() -> str | None:
    """The run folder the launching process chose, in a DDP process Lightning started (``LOCAL_RANK`` > 0
    and ``SSL_XCIT_RUN_DIR`` set), else None. Under torchrun/SLURM every process is started alike and
    :func:`place_run` has them agree instead."""
    if os.environ.get("LOCAL_RANK", "0") == "0" or RUN_DIR_ENV not in os.environ:
        return None
    # Lightning's children inherit the launching process's environment (a manual launch's WORLD_SIZE, RANK,
    # NODE_RANK included) plus SSL_XCIT_RUN_DIR; only torchrun and srun start every process themselves.
    return None if scheduler_launcher(os.environ) is not None else os.environ[RUN_DIR_ENV]


def _choose_run(root: Path, subcommand: str, ckpt_path: str | None) -> tuple[Path, str | None, bool]:
    """``(run folder, message, fresh)``: ``fresh`` when ``--ckpt_path last`` found nothing to resume."""
    if ckpt_path == "last":
        run = latest_resumable(root)
        if run is not None:
            return run, None, False
        if subcommand != "fit":
            raise FileNotFoundError(
                f"--ckpt_path last: no run under {root} has checkpoints/{LAST}; "
                f"train one first or give the checkpoint's path"
            )
        return (
            new_run_dir(root),
            f"--ckpt_path last: no earlier run under {root} to resume; starting a new run",
            True,
        )
    if ckpt_path and Path(ckpt_path).parent.name == "checkpoints" and subcommand != "fit":
        return (
            Path(ckpt_path).parent.parent,
            None,
            False,
        )  # evaluating a run's checkpoint: its logs join that run
    return new_run_dir(root), None, False


def place_run(
    config: Any, subcommand: str, run_dir: str | None, child_run_dir: str | None = None
) -> tuple[Path, str | None]:
    """Choose the run folder for ``config`` (one subcommand's jsonargparse namespace) and point the loggers,
    checkpoint callbacks and ``default_root_dir`` into it. Returns ``(run folder, message or None)``.

    ``ckpt_path: last`` becomes the chosen run's ``checkpoints/last.ckpt``: for ``fit`` that run is resumed in
    place; for ``validate``/``test``/``predict`` its logs go to a ``<subcommand>/`` subfolder of the run.
    """
    trainer = config.trainer
    for name, value in (("trainer.default_root_dir", trainer.default_root_dir), ("run_dir", run_dir)):
        if value and get_protocol(str(value)) != "file":
            # pathlib would turn "s3://b/runs" into a local folder "s3:/b/runs" and write there silently.
            raise UserError(
                f"{name} {value} is a remote URL, but the command line numbers and resumes runs in a folder on "
                "a local or mounted disk; give such a path (checkpoints on remote storage work from Python: "
                "Trainer(default_root_dir=URL) writes through Lightning's fsspec IO)"
            )
    root = Path(trainer.default_root_dir or "runs").expanduser()
    ckpt_path = getattr(config, "ckpt_path", None)
    if child_run_dir:  # a DDP process started by Lightning: the launcher already chose
        run, message, fresh = Path(child_run_dir), None, False
    elif run_dir:
        run, message, fresh = Path(run_dir).expanduser(), None, False
        run.mkdir(parents=True, exist_ok=True)
        if subcommand == "fit" and _slurm_restarts() > 0 and is_checkpoint(run / "checkpoints" / LAST):
            ckpt_path, message = "last", f"SLURM job requeued: resuming {run} from its {LAST}"
    else:
        launcher = detect_launcher(num_nodes=int(getattr(trainer, "num_nodes", 1) or 1))

        def choose() -> dict[str, Any]:
            requeued = requeued_run(root, subcommand)  # a requeued SLURM job goes on in its own run folder
            if requeued is not None:
                return requeued
            chosen, text, new = _choose_run(root, subcommand, ckpt_path)
            remember_slurm_run(root, chosen, subcommand)
            return {"run": str(chosen), "message": text, "fresh": new}

        choice = agree(launcher, root, choose) if launcher and launcher.world_size > 1 else choose()
        run, message, fresh = Path(choice["run"]), choice["message"], choice["fresh"]
        ckpt_path = choice.get("ckpt_path", ckpt_path)
    if ckpt_path == "last" and not fresh:
        config.ckpt_path = str(run / "checkpoints" / LAST)
        verb = "resuming" if subcommand == "fit" else "evaluating"
        message = message or f"--ckpt_path last: {verb} {run} from {config.ckpt_path}"
    elif fresh:
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
    make_dir(run / "checkpoints", private=owner_only())
    return run, message


# ------------------------------------------------------------------------------------------ SLURM requeue
def _slurm_restarts(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    return int(env.get("SLURM_RESTART_COUNT", "0") or "0") if env.get("SLURM_JOB_ID") else 0


def _slurm_record(root: Path, env: Mapping[str, str]) -> Path:
    job = (
        env.get("SLURM_ARRAY_JOB_ID") and f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}"
    )
    key = f"slurm-run.{job or env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')}"
    return root / ".requeue" / f"{_safe_name(key)}.json"


def remember_slurm_run(root: Path, run: Path, subcommand: str, env: Mapping[str, str] | None = None) -> None:
    """Inside a SLURM job, note which run folder this job (and job step) trains in, so that the job, once
    requeued (``scontrol requeue`` after a pre-emption), finds it again: :func:`requeued_run`."""
    env = os.environ if env is None else env
    if subcommand != "fit" or not env.get("SLURM_JOB_ID") or _slurm_restarts(env) > 0:
        return
    record = _slurm_record(root, env)
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"run": str(run)}))
    os.replace(partial, record)


def requeued_run(root: Path, subcommand: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """For ``fit`` in a requeued SLURM job (``SLURM_RESTART_COUNT`` >= 1): the run folder its first attempt
    recorded, resumed from its ``checkpoints/last.ckpt`` when there is one (a choice as ``place_run`` takes
    it); None otherwise. The run's own checkpoint wins over the command line's ``--ckpt_path``: it is newer."""
    env = os.environ if env is None else env
    if subcommand != "fit" or _slurm_restarts(env) < 1:
        return None
    record = _slurm_record(root, env)
    if not record.is_file():
        return None
    run = Path(json.loads(record.read_text())["run"])
    restarts = _slurm_restarts(env)
    if not is_checkpoint(run / "checkpoints" / LAST):
        message = f"SLURM job requeued ({restarts}x) before its first checkpoint: starting again in {run}"
        return {"run": str(run), "message": message, "fresh": False}
    message = f"SLURM job requeued ({restarts}x): resuming {run} from its {LAST}"
    return {"run": str(run), "message": message, "fresh": False, "ckpt_path": "last"}
