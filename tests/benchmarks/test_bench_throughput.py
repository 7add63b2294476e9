"""benchmarks/bench_throughput.py: the CI-size run times the module's own step (its optimiser, fused on request),
measures both modes, the limit, workers needed, FLOPs and the peer (or says why it was skipped)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from ssl_xcit.dino.module import DINO

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rates_are_measured(result: dict) -> None:
    for key in ("ceiling", "loader", "through_loader", "flops_per_image"):
        assert math.isfinite(result[key]) and result[key] > 0, key


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_ci_run_times_the_module_step_with_its_fused_optimizer(bench, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lightly", None)  # as on a machine without the `bench` extra
    result = bench.main(["--ci", "--augment-on", "device", "--peak-tflops", "1", "--fused"])
    out = capsys.readouterr().out
    _rates_are_measured(result)
    # The optimiser that stepped is the module's own (its class and its parameter groups), fused on request.
    module, opt = result["module"], result["optimizer"]
    own = DINO.configure_optimizers(module)
    assert type(opt) is type(own) and result["fused"] and opt.param_groups[0]["fused"] is True
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(p) for p in g["params"]] for g in own.param_groups
    ]
    assert opt.param_groups[1]["weight_decay"] == 0.0  # the module's no-decay group survived the rebuild
    assert module.global_step == 5  # warmup 1 + 3 timed + 1 closing batch, each a real optimiser step
    assert "augment_on=device" in out and "optimizer AdamW (module's, fused on)" in out
    assert "precision 32-true" in out and "timed with perf_counter" in out
    assert f"ratio (b) / (a): {result['through_loader'] / result['ceiling']:.2f}" in out
    needed = math.ceil(result["ceiling"] / result["per_worker"])
    assert f"workers per device to reach the ceiling: {needed}" in out
    assert f"MFU {100 * result['ceiling'] * result['flops_per_image'] / 1e12:.1f} %" in out
    assert result["peer"] is None and "(c) peer (lightly DINO): skipped: lightly is not installed" in out


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_without_a_known_peak_mfu_is_not_guessed_and_ibot_adds_flops(bench, capsys):
    plain = bench.main(["--ci", "--no-peer"])
    result = bench.main(["--ci", "--ibot"])
    out = capsys.readouterr().out
    _rates_are_measured(result)
    assert result["peak"] is None and "MFU n/a" in out and "MFU 0" not in out
    assert "iBOT on" in out and result["module"].hparams.ibot_loss_weight == 1.0
    assert result["flops_per_image"] > plain["flops_per_image"]  # the patch heads and loss are counted
    assert "skipped: lightly's DINO has no iBOT term" in out or "skipped: lightly is not installed" in out


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100", None),  # SXM or PCIe cannot be told apart: no guess
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_per_gpu_model(bench, name, peak):
    found, model = bench.peak_tflops(name)
    assert found == peak
    if peak is None:
        assert "unknown GPU" in model and "--peak-tflops" in model


def test_peer_is_timed_on_the_same_crops_when_lightly_is_installed(bench, capsys):
    pytest.importorskip("lightly")
    result = bench.main(["--ci"])
    out = capsys.readouterr().out
    assert math.isfinite(result["peer"]) and result["peer"] > 0
    assert f"ours (a) / peer: {result['ceiling'] / result['peer']:.2f}x (goal >= 1.2x)" in out
