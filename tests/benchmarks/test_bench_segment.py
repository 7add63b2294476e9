"""benchmarks/bench_segment.py on two CamVid images: a --weights row is probed exactly as the baseline rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from bench_scripts import doc_commands
from bench_scripts import load_script as _load

REPO = Path(__file__).resolve().parents[2]
CAMVID = REPO.parent / "shared" / "data" / "camvid"


@pytest.mark.skipif(not CAMVID.is_dir(), reason="needs ../shared/data/camvid")
def test_weights_row_of_the_random_init_backbone_equals_the_baseline_row(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_segment", REPO / "benchmarks" / "bench_segment.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from ssl_xcit.models import create_model

    torch.manual_seed(0)  # the baseline row's backbone, saved as a file a trained run would write
    model = create_model("xcit_nano_12_p8", depth=4)
    weights = tmp_path / "same.pth"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": {"backbone": "xcit_nano_12_p8",
                "backbone_kwargs": {"depth": 4}}}, weights)  # fmt: skip
    out = tmp_path / "rows.jsonl"
    rows = bench.main(["--limit", "2", "--short-side", "32", "--crop-size", "32", "--stride", "21", "--iters", "2",
                       "--batch-size", "2", "--threads", "1", "--weights", f"saved={weights}", "--json", str(out)])  # fmt: skip
    by_name = {row["name"]: row for row in rows}
    assert list(by_name) == ["saved", "XCiT-N12/8, 4 blocks, random init", "raw pixels"]
    saved, baseline = by_name["saved"], by_name["XCiT-N12/8, 4 blocks, random init"]
    assert saved["miou"] == pytest.approx(baseline["miou"], abs=1e-9)
    assert saved["per_class_iou"] == pytest.approx(baseline["per_class_iou"], abs=1e-9)
    assert [json.loads(line)["name"] for line in out.read_text().splitlines()] == list(by_name)


@pytest.mark.slow
@pytest.mark.skipif(not CAMVID.is_dir(), reason="needs ../shared/data/camvid")
def test_the_docs_camvid_commands_run(tmp_path, monkeypatch):
    """docs' bench_segment.py and CamVid learning.py commands, shrunk (later flags win): 2 images, 2 iterations
    of 2 crops of 32 px, one training step; the checkpoints their --weights name are written first."""
    from ssl_xcit.models import create_model

    monkeypatch.chdir(tmp_path)
    probes = doc_commands("bench_segment.py")
    trainings = [argv for argv in doc_commands("learning.py") if "camvid" in argv]
    assert len(probes) >= 2 and len(trainings) >= 2  # the floor and the curve; DINO and DINO + iBOT
    bench, learning = _load("bench_segment"), _load("learning")
    for argv in trainings:
        argv = [str(REPO / a) if a.startswith("recipes/") else a for a in argv]  # run from tmp_path
        result = learning.run(learning.parse_args([*argv, "--epochs", "1", "--limit-batches", "1",
                                                   "--batch-size", "4", "--workers", "0", "--threads", "1"]))  # fmt: skip
        assert result["steps"] == 1
    model = create_model("xcit_nano_12_p8", depth=4)
    for argv in probes:
        weights = [item for flag, item in zip(argv, argv[1:], strict=False) if flag == "--weights"]
        for path in (item.split("=", 1)[1] for item in weights):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save({"state_dict": model.state_dict(), "hyper_parameters": {"backbone": "xcit_nano_12_p8",
                        "backbone_kwargs": {"depth": 4}}}, path)  # fmt: skip
        rows = bench.main([*argv, "--limit", "2", "--short-side", "32", "--crop-size", "32", "--stride", "21",
                           "--iters", "2", "--batch-size", "2", "--threads", "1"])  # fmt: skip
        assert rows and all(0 <= row["miou"] <= 100 for row in rows)
