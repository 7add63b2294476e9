"""gpu_check's host-sync rows (``benchmarks/gpu_check_sync.py``, counter ``benchmarks/sync_count.py``) on the CPU.

Issue 51's first GPU run (one H200, the quickstart's model and data, ``augment_on`` device, 12 steps after 2,
logging and ``sync_every_n_steps`` every 4) counted 30 syncs in 6 of 12 steps under bf16-mixed (the same with the
progress bar on) and 39 in 6 of 12 under 16-mixed, against 3 syncing steps allowed. The loop census counts the
same 30 and 39 on the CPU, all in the 3 steps that read on purpose (the finite-loss read and that step's logging):
the counter's window, one batch end to the next, put a step's read and its logging (Lightning logs after the
batch-end hooks) in two windows. The counter now counts per iteration of Lightning's epoch loop, and names sites.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
STEPS, EVERY = 12, 4  # the GPU row's: measured steps, logging and sync_every_n_steps interval
READING = [1, 5, 9]  # the measured windows (after 2 warm-up steps) of batches 3, 7, 11: the reads' steps
# The sites of those steps: the finite-loss record's read, Lightning's logging (each logged tensor's .item()),
# and under 16-mixed the GradScaler's scale, read at the same point (ssl_xcit.dino.lifecycle._read_finite).
SITES = {"ssl_xcit/parallel/step_checks.py", "lightning/fabric/utilities/apply_func.py"}
SITES_16 = SITES | {"ssl_xcit/dino/lifecycle.py"}


def _module(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # gpu_check's dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _host() -> types.SimpleNamespace:
    return types.SimpleNamespace(**vars(_module("gpu_check")))


@pytest.mark.parametrize(
    "precision, bar",
    [
        ("32-true", False),
        pytest.param("32-true", True, marks=pytest.mark.slow),
        pytest.param("bf16-mixed", False, marks=pytest.mark.slow),
        pytest.param("bf16-mixed", True, marks=pytest.mark.slow),
        pytest.param("16-mixed", False, marks=pytest.mark.slow),
        pytest.param("16-mixed", True, marks=pytest.mark.slow),  # the suite's time budget; run with -m slow
    ],
)
def test_the_gpu_rows_setting_syncs_only_in_the_steps_that_read(tmp_path, precision, bar):
    """The GPU row's 12 steps (the quickstart's model, data with ``augment_on=device`` and its progress bar) under
    the CPU census: syncs in 3 steps of 12, each the step of a ``sync_every_n_steps`` read and its logging, sites
    named by line; none in the other 9."""
    host = _host()
    counter = {}
    sync_count = _module("sync_count")
    original = sync_count.SyncCounter

    class Kept(original):  # the row's counter, kept for its windows
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            counter["it"] = self

    sync_count.SyncCounter = Kept
    host._load = lambda name: sync_count if name == "sync_count" else _module(name)
    row = _module("gpu_check_sync").sync_row(host, host.Check(True, tmp_path), bar, precision, measured=STEPS)
    assert row.status == "skip" and row.result.startswith("n/a on a CPU ("), row.result
    assert f"in {STEPS} steps, {len(READING)} steps sync (allowed {STEPS // EVERY})" in row.result, row.result
    assert (", SyncedRichProgressBar" in row.setting) == bar
    windows = counter["it"].steps()[:STEPS]
    assert [w["batch_idx"] for w in windows] == list(range(2, 2 + STEPS))
    assert [i for i, w in enumerate(windows) if w["found"]] == READING, row.result
    files = {site.split(":")[0] for w in windows for site in w["found"]}
    assert files == (SITES_16 if precision == "16-mixed" else SITES), row.result
    sites = re.search(r"sites: (.*)\)$", row.result).group(1).split(", ")
    assert all(re.fullmatch(r"(ssl_xcit|lightning)/[\w/]+\.py:\d+ x\d+", s) for s in sites), sites


def test_the_cuda_counter_counts_per_loop_iteration_and_names_the_site(tmp_path, monkeypatch):
    """The CUDA path on the CPU: its windows are Lightning's iterations, so a step's read and its logging (after
    the batch-end hooks) are one syncing step; each sync warning's site is the innermost ssl_xcit or Lightning
    frame. The debug mode is stubbed and the warning raised where the GPU raises it (the read, each log write)."""
    import lightning as L
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    from ssl_xcit.parallel.step_checks import FiniteWatch

    sync_count = _module("sync_count")
    monkeypatch.setattr(sync_count.torch.cuda, "set_sync_debug_mode", lambda mode: None)

    def syncing(original):
        def wrapper(*args, **kwargs):
            warnings.warn(sync_count.SYNC_WARNING, UserWarning, stacklevel=1)
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(FiniteWatch, "read", syncing(FiniteWatch.read))
    monkeypatch.setattr(_LoggerConnector, "log_metrics", syncing(_LoggerConnector.log_metrics))
    spec = importlib.util.spec_from_file_location("dino_fixtures", REPO / "tests" / "dino" / "conftest.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)  # tests/dino's tiny model and in-memory crops
    from torch.utils.data import DataLoader

    from ssl_xcit.dino.module import DINO

    counter = sync_count.SyncCounter(skip=2, detector="cuda")
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=2 + STEPS + 1, log_every_n_steps=EVERY,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=[counter],
    )  # fmt: skip
    model = DINO(**{**fixtures.TINY, "sync_every_n_steps": EVERY, "collapse_guard": "off"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sync warning that escaped the counter would fail the test
        warnings.filterwarnings("ignore", message="^(?!.*synchronizing CUDA)")
        trainer.fit(model, DataLoader(fixtures.RandomCrops(2 * (3 + STEPS)), batch_size=2))
    assert counter.method == "CUDA sync debug mode"
    windows = counter.steps()[:STEPS]
    assert counter.per_step[:STEPS] == [2 if i in READING else 0 for i in range(STEPS)], counter.windows
    found = sorted({site.split(":")[0] + " " + site.split(" ")[-1] for w in windows for site in w["found"]})
    assert found == [
        "lightning/pytorch/trainer/connectors/logger_connector/logger_connector.py (update_train_step_metrics)",
        "ssl_xcit/dino/lifecycle.py (_read_finite)",
    ]
    assert sync_count.sites(windows) == {s: 3 for s in sync_count.sites(windows)}  # each in each reading step
