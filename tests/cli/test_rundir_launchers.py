"""Under torchrun or SLURM's srun without ``--run_dir`` every process joins one run folder (issue 19, item 5).

The folder is chosen before the process group exists: rank 0 chooses, and the others read its choice from
torchrun's key-value store, or from a file under the root named after the SLURM job step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ssl_xcit.cli.rundir import Launcher, detect_launcher

WORKER = Path(__file__).with_name("rundir_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    # A clean launcher environment: none of the runner's own SLURM/torchrun variables leak in.
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "SSL_XCIT_RUN_DIR"))
    }
    base = {k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _versions(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("version_"))


@pytest.mark.distributed
def test_torchrun_processes_join_one_run_folder(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "out"
    (root / "version_0").mkdir(parents=True)  # an earlier run
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
        f"--master_port={port}", str(WORKER), str(root), str(out), "fit",
    ]  # fmt: skip
    # The workers give up on their own after 60 s, so a failed agreement cannot outlive the test.
    env = _env(SSL_XCIT_RUN_DIR_TIMEOUT="60")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["run"] for r in _results(out)}
    assert runs == {str(root / "version_1")}
    assert _versions(root) == ["version_0", "version_1"]  # nobody made a folder of its own
    assert not (root / ".launches").exists()  # agreed through torchrun's store, no shared file needed


def _slurm(root: Path, out: Path, *args: str, job: str = "4242") -> None:
    """Two srun tasks of one job step; rank 1 starts first, so it really has to wait for rank 0."""
    procs = []
    for rank in (1, 0):
        env = _env(
            SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
            SLURM_NTASKS="2", SLURM_JOB_NAME="dino", SSL_XCIT_RUN_DIR_TIMEOUT="60",
        )  # fmt: skip
        cmd = [sys.executable, str(WORKER), str(root), str(out), *args]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]


@pytest.mark.distributed
def test_slurm_tasks_join_one_run_folder_and_a_requeue_gets_a_new_one(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    _slurm(root, out, "fit")
    assert {r["run"] for r in _results(out)} == {str(root / "version_0")}
    assert [p.name for p in (root / ".launches").iterdir()] == ["slurm.4242.0.0.json"]
    _slurm(root, out, "fit", job="4243")  # the next job
    assert {r["run"] for r in _results(out)} == {str(root / "version_1")}
    assert _versions(root) == ["version_0", "version_1"]


@pytest.mark.distributed
def test_slurm_ckpt_path_last_agrees_on_resume_and_on_the_error(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    _slurm(root, out, "fit", "last", job="1")  # nothing to resume: one new run, no checkpoint to load
    assert [(r["run"], r["ckpt_path"]) for r in _results(out)] == [(str(root / "version_0"), None)] * 2
    (root / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"x")
    _slurm(root, out, "fit", "last", job="2")
    last = str(root / "version_0" / "checkpoints" / "last.ckpt")
    assert [(r["run"], r["ckpt_path"]) for r in _results(out)] == [(str(root / "version_0"), last)] * 2
    # Rank 0's error reaches rank 1 instead of leaving it waiting.
    _slurm(tmp_path / "empty", out, "validate", "last", job="3")
    assert all("--ckpt_path last: no run under" in r["error"] for r in _results(out))


def test_detect_launcher_from_the_environment():
    torchrun = {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": "3",
        "WORLD_SIZE": "8",
        "TORCHELASTIC_RESTART_COUNT": "1",
    }
    assert detect_launcher(torchrun) == Launcher("torchrun", 3, 8, "torchrun.abc.1")
    slurm = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_STEP_ID": "2"}
    assert detect_launcher(slurm) == Launcher("slurm", 5, 16, "slurm.77.2.0")
    assert detect_launcher({**slurm, "SLURM_RESTART_COUNT": "1"}).key == "slurm.77.2.1"  # a requeued job
    # One task (Lightning starts the processes itself) or an interactive shell: not an external launcher.
    assert detect_launcher({**slurm, "SLURM_NTASKS": "1"}) is None
    assert detect_launcher({**slurm, "SLURM_JOB_NAME": "bash"}) is None
    assert detect_launcher({}) is None
