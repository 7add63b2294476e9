"""Processes of one launch agreeing on a value before the process group exists (the run folder).

Which launcher started this process (:func:`detect_launcher`), and :func:`agree`: global rank 0 decides and the
others read its decision, through torchrun's key-value store, or through a file under the run root (see
``ssl_xcit.cli.rundir`` for which launcher uses which).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ssl_xcit.errors import UserError

# Seconds a rank waits for rank 0's choice (rank 0 may still be importing, or listing a slow filesystem).
AGREE_TIMEOUT_S = float(os.environ.get("SSL_XCIT_RUN_DIR_TIMEOUT", "600"))


@dataclass(frozen=True)
class Launcher:
    """An external launcher that started this process as one of ``world_size``.

    ``key`` names this launch, attempt included (a restarted torchrun group or a requeued SLURM job chooses
    anew), so a choice is never read from an earlier launch.
    """

    name: str  # "torchrun", "slurm", "mpi" or "env"
    rank: int
    world_size: int  # the processes that take part in choosing: all of them, or one per node for NODE_RANK
    key: str

    @property
    def handshake(self) -> bool:
        """Whether ``key`` can name an earlier launch too (agreed through a handshake, see the module doc)."""
        return self.name in ("mpi", "env")


# MPI implementations' (rank, size) variables, and the variables naming the job all its processes share.
_MPI_RANKS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", None))
_MPI_JOBS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")


def detect_launcher(env: Mapping[str, str] | None = None, num_nodes: int = 1) -> Launcher | None:
    """The external launcher of this process (torchrun, SLURM's srun with several tasks, MPI, or any launcher
    that sets ``WORLD_SIZE > 1``), or None. ``num_nodes`` (the trainer's) counts the processes started by hand
    when only ``NODE_RANK`` is set: one per node, Lightning starting the others."""
    env = os.environ if env is None else env
    return scheduler_launcher(env) or _mpi_launcher(env) or _env_launcher(env, num_nodes)


def scheduler_launcher(env: Mapping[str, str]) -> Launcher | None:
    """torchrun or srun: launchers that start every process and name each launch uniquely."""
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


def _launch_address(env: Mapping[str, str]) -> str | None:
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def _mpi_launcher(env: Mapping[str, str]) -> Launcher | None:
    for rank_var, size_var in _MPI_RANKS:
        size = env.get(size_var or "WORLD_SIZE", "1") or "1"
        if rank_var in env and int(size) > 1:
            job = next((env[v] for v in _MPI_JOBS if env.get(v)), None) or _launch_address(env)
            if job is None:
                raise UserError(
                    f"{size} MPI processes, but no variable they all share names the launch ({', '.join(_MPI_JOBS)} "
                    "or MASTER_ADDR and MASTER_PORT), so they cannot agree on a run folder: pass --run_dir"
                )
            return Launcher("mpi", int(env[rank_var]), int(size), f"mpi.{job}")
    return None


def _env_launcher(env: Mapping[str, str], num_nodes: int) -> Launcher | None:
    world = int(env.get("WORLD_SIZE", "1") or "1")
    if world <= 1:
        return None
    address = _launch_address(env)
    if "RANK" in env:  # the launcher started every process
        rank, size = int(env["RANK"]), world
    elif "NODE_RANK" in env or "GROUP_RANK" in env:  # one process per node started by hand
        rank, size = int(env.get("NODE_RANK", env.get("GROUP_RANK", "0"))), max(int(num_nodes), 1)
    else:
        rank, size = -1, world
    if rank < 0 or address is None:
        raise UserError(
            f"WORLD_SIZE={world} but no RANK or NODE_RANK, or no MASTER_ADDR and MASTER_PORT, in the environment: "
            "the processes cannot agree on a run folder; pass --run_dir (the same folder to every process)"
        )
    return None if size <= 1 else Launcher("env", rank, size, f"env.{address}")


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def agree(launcher: Launcher, root: Path, choose: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Rank 0 runs ``choose()`` (a JSON-able dict); every rank returns that dict. An error on rank 0 is raised
    on every rank, so none waits for a choice that never comes."""
    if launcher.handshake:
        return _agree_by_handshake(launcher, root, choose)
    if launcher.rank == 0:
        try:
            choice = choose()
        except Exception as err:
            _publish(launcher, root, {"error": str(err), "type": type(err).__name__})
            raise
        _publish(launcher, root, choice)
        return choice
    return _raise_if_error(_receive(launcher, root))


def _raise_if_error(choice: dict[str, Any]) -> dict[str, Any]:
    if "error" in choice:
        kinds = {"FileNotFoundError": FileNotFoundError, "UserError": UserError, "ValueError": ValueError}
        kind = kinds.get(choice["type"], RuntimeError)
        raise kind(choice["error"])
    return choice


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)  # readers never see half a file


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _timeout(launcher: Launcher, what: str) -> TimeoutError:
    return TimeoutError(
        f"{launcher.name} rank {launcher.rank}: {what} within {AGREE_TIMEOUT_S:.0f} s "
        "(SSL_XCIT_RUN_DIR_TIMEOUT); default_root_dir must be on a filesystem every node shares, or pass --run_dir"
    )


def _agree_by_handshake(
    launcher: Launcher, root: Path, choose: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The claim-file agreement for launch names that repeat (see the module doc). Files under
    ``<root>/.launches``: ``<key>.json`` (rank 0's claim, with a fresh nonce), ``<key>.<nonce>.ack<R>`` (rank
    R read it) and ``<key>.<nonce>.done`` (every rank read it; the claim is then removed)."""
    claim = _claim_file(launcher, root)
    stem = claim.name[: -len(".json")]
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    if launcher.rank == 0:
        # Before rank 0 writes, every file of this name is a leftover of an earlier launch.
        for old in [claim, *claim.parent.glob(f"{stem}.*.ack*"), *claim.parent.glob(f"{stem}.*.done")]:
            old.unlink(missing_ok=True)
        nonce = uuid.uuid4().hex
        try:
            payload = choose()
        except Exception as err:  # passed on to every rank, then raised here
            payload, failure = {"error": str(err), "type": type(err).__name__}, err
        else:
            failure = None
        _write_json(claim, {"nonce": nonce, **payload})
        acks = [claim.parent / f"{stem}.{nonce}.ack{r}" for r in range(1, launcher.world_size)]
        while not all(a.is_file() for a in acks):
            if time.monotonic() > deadline:
                if failure is not None:
                    raise failure
                missing = [r for r, a in enumerate(acks, 1) if not a.is_file()]
                raise _timeout(
                    launcher, f"ranks {missing[:10]} did not read the run folder chosen in {claim}"
                )
            time.sleep(0.1)
        (claim.parent / f"{stem}.{nonce}.done").touch()
        claim.unlink()
        for ack in acks:
            ack.unlink(missing_ok=True)
        if failure is not None:
            raise failure
        return payload
    while True:
        read = _read_json(claim)
        if read is None:
            if time.monotonic() > deadline:
                raise _timeout(launcher, f"rank 0 did not record the run folder in {claim}")
            time.sleep(0.1)
            continue
        nonce = read.pop("nonce")
        (claim.parent / f"{stem}.{nonce}.ack{launcher.rank}").touch()
        done = claim.parent / f"{stem}.{nonce}.done"
        # Wait for rank 0 to confirm this claim; a leftover one is replaced (or removed) instead.
        while not done.is_file():
            current = _read_json(claim)
            if (current is None or current.get("nonce") != nonce) and not done.is_file():
                break
            if time.monotonic() > deadline:
                raise _timeout(launcher, f"rank 0 did not confirm the run folder in {claim}")
            time.sleep(0.1)
        else:
            return _raise_if_error(read)


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
    _write_json(_claim_file(launcher, root), choice)


def _receive(launcher: Launcher, root: Path) -> dict[str, Any]:
    store = _agent_store(launcher)
    if store is not None:
        return json.loads(store.get("choice").decode())  # blocks until rank 0 has set it (or the timeout)
    claim = _claim_file(launcher, root)
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while not claim.is_file():
        if time.monotonic() > deadline:
            raise _timeout(launcher, f"rank 0 did not record the run folder in {claim}")
        time.sleep(0.2)
    return json.loads(claim.read_text())
