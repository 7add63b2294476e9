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
  on a filesystem every node shares (as it must be for ``--ckpt_path``), or pass ``--run_dir``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from fsspec.utils import get_protocol

from ssl_xcit.errors import UserError
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


# Seconds a rank waits for rank 0's choice (rank 0 may still be importing, or listing a slow filesystem).
AGREE_TIMEOUT_S = float(os.environ.get("SSL_XCIT_RUN_DIR_TIMEOUT", "600"))


@dataclass(frozen=True)
class Launcher:
    """An external launcher that started this process as one of ``world_size``.

    ``key`` names this launch, attempt included (a restarted torchrun group or a requeued SLURM job chooses
    anew), so a choice is never read from an earlier launch.
    """

    name: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    key: str


def detect_launcher(env: Mapping[str, str] | None = None) -> Launcher | None:
    """The external launcher of this process (torchrun, or SLURM's srun with several tasks), or None."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:  # torch.distributed.is_torchelastic_launched()
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"torchrun.{env['TORCHELASTIC_RUN_ID']}.{attempt}"
        return Launcher("torchrun", int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), key)
    tasks = int(env.get("SLURM_NTASKS", "1") or "1")
    # Lightning treats a job named bash/interactive as a shell it launches processes from (not srun tasks).
    interactive = env.get("SLURM_JOB_NAME") in ("bash", "interactive")
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and tasks > 1 and not interactive:
        step, restart = env.get("SLURM_STEP_ID", "0"), env.get("SLURM_RESTART_COUNT", "0")
        key = f"slurm.{env['SLURM_JOB_ID']}.{step}.{restart}"
        return Launcher("slurm", int(env["SLURM_PROCID"]), tasks, key)
    return None


def inherited_run_dir() -> str | None:
    """The run folder the launching process chose, in a DDP process Lightning started (``LOCAL_RANK`` > 0
    and ``SSL_XCIT_RUN_DIR`` set), else None. Under torchrun/SLURM every process is started alike and
    :func:`place_run` has them agree instead."""
    started_by_lightning = os.environ.get("LOCAL_RANK", "0") != "0" and detect_launcher() is None
    return os.environ.get(RUN_DIR_ENV) if started_by_lightning else None


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def agree(launcher: Launcher, root: Path, choose: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Rank 0 runs ``choose()`` (a JSON-able dict); every rank returns that dict. An error on rank 0 is raised
    on every rank, so none waits for a choice that never comes."""
    if launcher.rank == 0:
        try:
            choice = choose()
        except Exception as err:
            _publish(launcher, root, {"error": str(err), "type": type(err).__name__})
            raise
        _publish(launcher, root, choice)
        return choice
    choice = _receive(launcher, root)
    if "error" in choice:
        kinds = {"FileNotFoundError": FileNotFoundError, "UserError": UserError, "ValueError": ValueError}
        kind = kinds.get(choice["type"], RuntimeError)
        raise kind(choice["error"])
    return choice


def _agent_store(launcher: Launcher) -> Any | None:
    """torchrun's own TCPStore (as torch's env:// initialisation reuses it), or None outside torchrun."""
    if launcher.name != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=AGREE_TIMEOUT_S),
    )
    return PrefixStore(f"ssl_xcit/run_dir/{launcher.key}", store)


def _claim_file(launcher: Launcher, root: Path) -> Path:
    return root / ".launches" / f"{_safe_name(launcher.key)}.json"


def _publish(launcher: Launcher, root: Path, choice: dict[str, Any]) -> None:
    text = json.dumps(choice)
    store = _agent_store(launcher)
    if store is not None:
        store.set("choice", text)
        return
    claim = _claim_file(launcher, root)
    claim.parent.mkdir(parents=True, exist_ok=True)
    partial = claim.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(text)
    os.replace(partial, claim)  # readers never see half a file


def _receive(launcher: Launcher, root: Path) -> dict[str, Any]:
    store = _agent_store(launcher)
    if store is not None:
        return json.loads(store.get("choice").decode())  # blocks until rank 0 has set it (or the timeout)
    claim = _claim_file(launcher, root)
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while not claim.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{launcher.name} rank {launcher.rank}: rank 0 did not record the run folder in {claim} within "
                f"{AGREE_TIMEOUT_S:.0f} s; default_root_dir must be on a filesystem every node shares, or pass "
                "--run_dir"
            )
        time.sleep(0.2)
    return json.loads(claim.read_text())


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
        if subcommand == "fit" and _slurm_restarts() > 0 and (run / "checkpoints" / LAST).is_file():
            ckpt_path, message = "last", f"SLURM job requeued: resuming {run} from its {LAST}"
    else:
        launcher = detect_launcher()

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
    if not (run / "checkpoints" / LAST).is_file():
        message = f"SLURM job requeued ({restarts}x) before its first checkpoint: starting again in {run}"
        return {"run": str(run), "message": message, "fresh": False}
    message = f"SLURM job requeued ({restarts}x): resuming {run} from its {LAST}"
    return {"run": str(run), "message": message, "fresh": False, "ckpt_path": "last"}
