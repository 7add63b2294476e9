"""benchmarks/bench_segment.py on two CamVid images: a --weights row is probed exactly as the baseline rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

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
