"""A requeued SLURM job finds the run folder of its first attempt (``ssl_xcit.cli.rundir``), and every
training recipe writes the step checkpoints its resume needs."""

from __future__ import annotations

from pathlib import Path

import yaml

from ssl_xcit.cli.rundir import remember_slurm_run, requeued_run

ROOT = Path(__file__).resolve().parents[2]
JOB = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}


def test_a_requeued_job_resumes_the_run_its_first_attempt_recorded(tmp_path):
    root, run = tmp_path / "runs", tmp_path / "runs" / "version_3"
    remember_slurm_run(root, run, "fit", JOB)
    assert requeued_run(root, "fit", JOB) is None  # the first attempt itself
    # Requeued before its first checkpoint: the same folder, nothing to resume from.
    first = requeued_run(root, "fit", {**JOB, "SLURM_RESTART_COUNT": "1"})
    assert first["run"] == str(run) and "ckpt_path" not in first and not first["fresh"]
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    again = requeued_run(root, "fit", {**JOB, "SLURM_RESTART_COUNT": "2"})
    assert again["run"] == str(run) and again["ckpt_path"] == "last"
    assert again["message"] == f"SLURM job requeued (2x): resuming {run} from its last.ckpt"


def test_other_jobs_steps_and_commands_are_not_taken_for_a_requeue(tmp_path):
    root = tmp_path / "runs"
    remember_slurm_run(root, root / "version_0", "fit", JOB)
    restarted = {**JOB, "SLURM_RESTART_COUNT": "1"}
    assert requeued_run(root, "fit", {**restarted, "SLURM_JOB_ID": "78"}) is None
    assert requeued_run(root, "fit", {**restarted, "SLURM_STEP_ID": "1"}) is None  # a second srun step
    assert requeued_run(root, "validate", restarted) is None
    remember_slurm_run(root, root / "version_1", "fit", {})  # outside SLURM: nothing recorded
    remember_slurm_run(
        root, root / "version_1", "fit", restarted
    )  # a requeued attempt keeps the first record
    assert requeued_run(root, "fit", restarted)["run"] == str(root / "version_0")
    array = {"SLURM_JOB_ID": "90", "SLURM_ARRAY_JOB_ID": "89", "SLURM_ARRAY_TASK_ID": "3"}
    remember_slurm_run(root, root / "version_2", "fit", array)
    task_4 = {**array, "SLURM_ARRAY_TASK_ID": "4", "SLURM_RESTART_COUNT": "1"}
    assert requeued_run(root, "fit", task_4) is None  # another task of the array
    assert requeued_run(root, "fit", {**array, "SLURM_RESTART_COUNT": "1"})["run"] == str(root / "version_2")


def test_every_training_recipe_writes_last_ckpt_every_n_steps_and_every_epoch():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) >= 11
    for recipe in recipes:
        callbacks = yaml.safe_load(recipe.read_text())["trainer"]["callbacks"]
        last = [
            c.get("init_args", {})
            for c in callbacks
            if c["class_path"].endswith("ModelCheckpoint")
            and c.get("init_args", {}).get("filename") == "last"
        ]
        steps = [a["every_n_train_steps"] for a in last if a.get("every_n_train_steps")]
        epochs = [a for a in last if a.get("every_n_epochs") == 1 and a.get("save_on_train_epoch_end")]
        assert len(steps) == 1 and steps[0] >= 1 and len(epochs) == 1, recipe.name
        kept = [c for c in callbacks if c.get("init_args", {}).get("filename") == "{epoch:04d}"]
        assert len(kept) == 1 and kept[0]["init_args"]["save_top_k"] == -1, recipe.name  # the kept copies
