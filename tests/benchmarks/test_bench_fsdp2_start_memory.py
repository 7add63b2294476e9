"""benchmarks/bench_fsdp2_start_memory.py: the peak reading and the ratio's arithmetic, the documented command,
and (slow) a tiny run of both starts on 2 gloo processes."""

from __future__ import annotations

import pytest
from bench_scripts import doc_commands, load_script


def test_the_peak_reading_sees_new_memory_and_the_ratio_is_the_measured_bytes_over_the_whole():
    import torch

    bench = load_script("bench_fsdp2_start_memory")
    with open("/proc/self/clear_refs", "w") as handle:  # the peak so far (earlier tests') back to the present
        handle.write("5")
    before = bench.vm_hwm_kib()
    block = torch.ones(48 * 2**20, dtype=torch.uint8)  # 48 MiB, every page written
    assert bench.vm_hwm_kib() - before >= 40 * 1024
    del block
    record = {"baseline_kib": 1000, "peak_kib": 1000 + 3 * 1024, "whole_bytes": 4 * 1024 * 1024}
    assert bench.ratio(record) == 0.75


def test_the_documented_command_parses():
    bench = load_script("bench_fsdp2_start_memory")
    commands = doc_commands("bench_fsdp2_start_memory.py")
    assert commands, "docs/ name no bench_fsdp2_start_memory command"
    for argv in commands:
        args = bench.build_parser().parse_args(argv)
        assert set(args.starts.split(",")) <= set(bench.STARTS), argv
    with pytest.raises(SystemExit):
        bench.main(["--starts", "sharded"])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tiny_run_measures_both_starts(capsys):
    """Both starts reach the training start with every parameter sharded; the byte count is the model's (an
    independent count of a whole construction); at this size the fixed costs of a fit dominate, so only the
    order is checked (the meta start holds one network less)."""
    from ssl_xcit.dino.module import DINO

    bench = load_script("bench_fsdp2_start_memory")
    rows = bench.main(["--tiny"])
    backbone, kwargs = bench.MODELS["tiny"]
    model = DINO(backbone, backbone_kwargs=kwargs, out_dim=256)
    nets = (model.student, model.teacher)
    whole = 4 * sum(t.numel() for net in nets for t in [*net.parameters(), *net.buffers()])
    assert [row["start"] for row in rows] == ["whole", "meta"]
    for row in rows:
        assert [r["rank"] for r in row["records"]] == [0, 1]
        for record, value in zip(row["records"], row["ratios"], strict=True):
            assert record["whole_bytes"] == whole and record["param_types"] == ["DTensor"]
            assert value == bench.ratio(record) > 0
    assert rows[1]["largest"] < rows[0]["largest"]
    assert capsys.readouterr().out.count("\n") == 3
