from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ssl_xcit.visualize.common import VisualizeError
from ssl_xcit.visualize.curves import collapse_regions, curves_figure, read_metrics

FIXTURE = Path(__file__).parent / "data" / "quickstart_run"  # the measured 4-epoch quickstart (124 steps)


def _write(tmp_path, entropy, kl, out_dim=None):
    run = tmp_path / "run" / "csv" / "version_0"
    run.mkdir(parents=True)
    rows = ["step,train/teacher_entropy,train/kl_to_uniform,knn/top1"]
    rows += [f"{s},{h},{k}," for s, (h, k) in enumerate(zip(entropy, kl, strict=True))]
    rows.append(f"{len(entropy) - 1},,,42.0")  # the k-NN callback logs on its own rows
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    if out_dim:
        (run / "hparams.yaml").write_text(f"backbone: xcit_nano_12_p16\nout_dim: {out_dim}\n")
    return tmp_path / "run"


def test_the_real_run_fixture_reads_every_panel():
    metrics = read_metrics(FIXTURE)
    assert metrics.out_dim == 256  # from the run's hparams.yaml
    for column in (
        "train/loss_step",
        "train/lr",
        "train/teacher_temp",
        "knn/top1",
        "train/teacher_entropy",
        "train/kl_to_uniform",
    ):
        assert column in metrics.series
    steps, top1 = metrics.series["knn/top1"]
    assert steps[0] == 0 and len(steps) == 5  # before training, then after each of the 4 epochs
    assert [round(float(v), 1) for v in top1] == [17.2, 36.0, 47.4, 53.8, 55.0]  # the quickstart curve
    fig = curves_figure(metrics)
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    assert pixels.shape[:2] == (600, 1200) and pixels.std() > 10


def test_collapse_regions_on_constructed_logs(tmp_path):
    log_k = math.log(100)
    entropy = [3.0, 3.0, log_k - 0.01, log_k, 3.0, 0.01, 0.02, 3.0]
    kl = [0.5, 0.5, 0.01, 0.0, 0.5, log_k - 0.1, log_k, 0.5]
    metrics = read_metrics(_write(tmp_path, entropy, kl, out_dim=100))
    regions = collapse_regions(metrics)
    assert regions == {"uniform": [(1.5, 3.5)], "one prototype": [(4.5, 6.5)]}
    # A sharp but diverse teacher (low entropy, low KL) is not a collapse.
    assert (
        collapse_regions(read_metrics(_write(tmp_path / "b", [0.01] * 3, [0.1] * 3, 100)))["one prototype"]
        == []
    )
    # --out-dim overrides; without any K nothing is shaded.
    assert collapse_regions(read_metrics(_write(tmp_path / "c", entropy, kl)))["uniform"] == []
    assert collapse_regions(read_metrics(tmp_path / "c" / "run", out_dim=100)) == regions


def test_run_without_metrics_names_the_folder(tmp_path):
    with pytest.raises(VisualizeError, match=f"no metrics.csv under {tmp_path}"):
        read_metrics(tmp_path)
    with pytest.raises(VisualizeError, match="run directory not found: .*missing"):
        read_metrics(tmp_path / "missing")


def test_ibot_runs_get_a_patch_row_with_their_own_collapse_regions(tmp_path):
    run = tmp_path / "run" / "csv" / "version_0"
    run.mkdir(parents=True)
    log_k = math.log(64)
    rows = ["step,train/teacher_entropy,train/kl_to_uniform,train/ibot_loss,train/ibot_teacher_entropy,"
            "train/ibot_kl_to_uniform"]  # fmt: skip
    patch = [(3.0, 0.5), (log_k, 0.0), (log_k - 0.01, 0.01), (3.0, 0.5)]  # uniform at steps 1-2
    rows += [f"{s},2.0,0.4,{5 - s},{h},{k}" for s, (h, k) in enumerate(patch)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    (run / "hparams.yaml").write_text("out_dim: 256\nibot_out_dim: 64\n")
    metrics = read_metrics(tmp_path / "run")
    assert (metrics.out_dim, metrics.ibot_out_dim) == (256, 64)
    assert collapse_regions(metrics, "ibot") == {"uniform": [(0.5, 2.5)], "one prototype": []}
    assert collapse_regions(metrics) == {"uniform": [], "one prototype": []}  # the DINO term is healthy
    fig = curves_figure(metrics)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 9 and "iBOT patch loss" in titles and "patch teacher entropy (nats)" in titles
    patch_axis = fig.axes[titles.index("patch teacher entropy (nats)")]
    assert len(patch_axis.patches) == 1  # the shaded uniform span
