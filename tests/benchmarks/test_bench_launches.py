"""benchmarks/bench_launches.py at a tiny size: one DINO step's aten operators, counted on the meta device and
on real CPU tensors, and the host's time per step (a model cut in width, the meta device, fake tensors)."""

from __future__ import annotations

import math

import pytest
import torch
from bench_scripts import doc_commands, load_script


@pytest.mark.slow  # ~7 s: a profiled tiny run (the suite's time budget)
def test_tiny_run_counts_the_step_s_operators_and_times_the_host(capsys):
    bench = load_script("bench_launches")
    (result,) = bench.main(["--tiny", "--models", "quickstart", "--steps", "2", "--warmup", "0", "--fake"])
    out = capsys.readouterr().out
    meta, real = result["meta"], result["real"]
    classes = meta.classes
    assert classes["kernel"] > 100 and classes["view"] > 100 and classes["host"] > 0
    assert sum(classes.values()) == meta.total
    # the host class is AdamW's CPU step counters: a meta model's own tensors never land there
    assert meta.ops[torch.ops.aten._local_scalar_dense.default] > 0
    # real CPU tensors: the same step but for scaled_dot_product_attention's backend; autocast adds casts
    sdpa = [op for op in real["32"].ops if "scaled_dot_product" in str(op)]
    assert sdpa and real["bf16-mixed"].total > real["32"].total
    differ = {str(op) for op in set(meta.ops) | set(real["32"].ops) if meta.ops[op] != real["32"].ops[op]}
    attention = {"softmax", "scaled_dot_product", "bmm", "view", "transpose", "expand", "clone", "mul.Scalar"}
    assert all(any(a in op for a in attention) for op in differ), differ
    assert result["own_batch"] == real["32"].total  # its own batch (2 in --tiny) counts the same
    for key in ("host_ms", "wall_ms", "meta_ms", "fake_ms"):
        assert math.isfinite(result[key]) and result[key] > 0
    # the host-time model (cut in width, batch 1, small crops) runs the full model's operators, near enough
    assert abs(result["host_ops"] - real["32"].total) <= 0.05 * real["32"].total
    assert "quickstart" in out and "host ms" in out and "the host-time model runs" in out


def test_the_documented_commands_parse():
    bench = load_script("bench_launches")
    commands = doc_commands("bench_launches.py")
    assert commands, "docs/benchmarks.md names no bench_launches command"
    for argv in commands:
        names = dict(zip(argv, [*argv[1:], ""], strict=True)).get("--models", ",".join(bench.MODELS))
        assert set(names.split(",")) <= set(bench.MODELS), argv
    assert ["--fake"] in commands and ["--tiny"] in commands  # the measured table's command, the test's size
