"""benchmarks/bench_checkpoint_reads.py at tiny size: its checkpoint is a sharded folder every reader takes,
each mode writes what the others write (old and new export the same backbone, gather the same state), and the
end-to-end run reports one row per mode, the new reads below the old (slow: a process per mode)."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import doc_commands, load_script
from safetensors.torch import load_file

from ssl_xcit.models.sharded import is_sharded_checkpoint


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_checkpoint_reads")


def test_old_and_new_reads_write_the_same(bench, tmp_path):
    folder = bench.build_checkpoint(tmp_path / "tiny.ckpt", "xcit_nano_12_p16", 32, hidden_dim=16, depth=1)
    assert is_sharded_checkpoint(folder)
    out = {mode: tmp_path / f"{mode}.{'safetensors' if 'export' in mode else 'ckpt'}" for mode in bench.MODES}
    for mode in bench.MODES:
        result = bench.child(mode, folder, out[mode])
        assert result["peak"] >= 0 and result["seconds"] > 0
    old, new = load_file(out["export-old"]), load_file(out["export"])
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    old, new = (torch.load(out[m], weights_only=True) for m in ("gather-old", "gather"))
    assert old.keys() == new.keys() and old["state_dict"].keys() == new["state_dict"].keys()
    assert all(torch.equal(v, new["state_dict"][k]) for k, v in old["state_dict"].items())
    moments = old["optimizer_states"][0]["state"]
    assert all(
        torch.equal(t, new["optimizer_states"][0]["state"][n][m])
        for n, ms in moments.items()
        for m, t in ms.items()
    )


@pytest.mark.slow
def test_tiny_run_reports_a_row_per_mode(bench, tmp_path, capsys):
    rows = bench.main(["--tiny", "--work", str(tmp_path)])
    assert [r["mode"] for r in rows] == list(bench.MODES)
    ratio = {r["mode"]: r["ratio"] for r in rows}
    assert ratio["export"] < ratio["export-old"] and ratio["gather"] < ratio["gather-old"]
    assert capsys.readouterr().out.count("\n") == 2 + len(bench.MODES)


def test_the_documented_command_parses(bench):
    commands = doc_commands("bench_checkpoint_reads.py")
    assert commands, "docs/scaling.md names no bench_checkpoint_reads command"
    for argv in commands:
        args = bench.build_parser().parse_args(argv)
        assert set(args.modes.split(",")) <= set(bench.MODES), argv
