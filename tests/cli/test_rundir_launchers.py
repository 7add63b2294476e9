"""Under any launcher that starts several processes (torchrun, SLURM's srun, MPI, a user's own script setting
WORLD_SIZE and RANK or NODE_RANK) every process joins one run folder without ``--run_dir`` (issues 19 and 26).

The folder is chosen before the process group exists: rank 0 chooses, and the others read its choice from
torchrun's key-value store, or from a file under the root named after the launch.
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
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in base.items() if k not in launch and not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
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


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
@pytest.mark.distributed
def test_slurm_tasks_join_one_run_folder_and_a_requeue_gets_a_new_one(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    _slurm(root, out, "fit")
    assert {r["run"] for r in _results(out)} == {str(root / "version_0")}
    assert [p.name for p in (root / ".launches").iterdir()] == ["slurm.4242.0.0.json"]
    # The job's record of its run folder, for a requeue (ssl_xcit.cli.rundir), lives apart from the claims.
    assert [p.name for p in (root / ".requeue").iterdir()] == ["slurm-run.4242.0.json"]
    _slurm(root, out, "fit", job="4243")  # the next job
    assert {r["run"] for r in _results(out)} == {str(root / "version_1")}
    assert _versions(root) == ["version_0", "version_1"]


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
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


def _launch(root: Path, out: Path, envs: list[dict[str, str]], *args: str) -> None:
    """One plain process per environment, the last one (rank 0) started last, as a user's own launcher would."""
    procs = []
    for extra in envs:
        cmd = [sys.executable, str(WORKER), str(root), str(out), *args]
        env = _env(SSL_XCIT_RUN_DIR_TIMEOUT="60", **extra)
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]


def _manual(port: int, *ranks: int) -> list[dict[str, str]]:
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [{**common, "RANK": str(r), "NODE_RANK": str(r)} for r in ranks]


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
@pytest.mark.distributed
def test_manually_launched_processes_join_one_run_folder_also_when_relaunched(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    _launch(root, out, _manual(29517, 1, 0), "fit")
    assert {r["run"] for r in _results(out)} == {str(root / "version_0")}
    assert _versions(root) == ["version_0"]
    # The same address again (a relaunch), after a crash left a claim of its own behind: a new folder, agreed.
    (root / ".launches" / "env.127.0.0.1_29517.json").write_text(json.dumps({"nonce": "old", "run": "x"}))
    _launch(root, out, _manual(29517, 1, 0), "fit")
    assert {r["run"] for r in _results(out)} == {str(root / "version_1")}
    assert _versions(root) == ["version_0", "version_1"]
    assert not list((root / ".launches").glob("*.json")) and not list((root / ".launches").glob("*.ack*"))


@pytest.mark.slow  # ~8 s; the hand-started launch test covers the same claim files by default
@pytest.mark.distributed
def test_mpi_and_node_rank_launches_join_one_run_folder(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    mpi = [
        {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "PMIX_NAMESPACE": "prterun-h-1@1"}
        for r in (1, 0)
    ]
    _launch(root, out, mpi, "fit")
    assert {r["run"] for r in _results(out)} == {str(root / "version_0")}
    # One command per node (Lightning starts each node's other processes): WORLD_SIZE counts all of them.
    nodes = [
        {"WORLD_SIZE": "8", "NODE_RANK": str(r), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
        for r in (1, 0)
    ]
    _launch(root, out, nodes, "fit", "", "2")
    assert {r["run"] for r in _results(out)} == {str(root / "version_1")}
    assert _versions(root) == ["version_0", "version_1"]


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
    # MPI: Open MPI, MPICH/Intel (PMI), keyed by the job they share.
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_ess_base_jobid": "7"}
    assert detect_launcher(ompi) == Launcher("mpi", 1, 4, "mpi.7")
    pmi = {"PMI_RANK": "2", "PMI_SIZE": "3", "MASTER_ADDR": "n1", "MASTER_PORT": "5"}
    assert detect_launcher(pmi) == Launcher("mpi", 2, 3, "mpi.n1:5")
    with pytest.raises(ValueError, match=r"3 MPI processes.*pass --run_dir"):
        detect_launcher({"PMI_RANK": "2", "PMI_SIZE": "3"})
    # Any other launcher: WORLD_SIZE > 1 with RANK (it starts every process) or NODE_RANK (one per node).
    kubeflow = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert detect_launcher(kubeflow) == Launcher("env", 3, 4, "env.job-master-0:23456")
    per_node = {"WORLD_SIZE": "16", "NODE_RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    assert detect_launcher(per_node, num_nodes=2) == Launcher("env", 1, 2, "env.a:1")
    assert detect_launcher(per_node, num_nodes=1) is None  # one node: Lightning starts every process
    assert detect_launcher({"WORLD_SIZE": "1", "RANK": "0"}) is None
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 but no RANK or NODE_RANK.*pass --run_dir"):
        detect_launcher({"WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
