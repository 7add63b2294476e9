"""benchmarks/resize_folder.py: the same tree with each shorter side at S px, small images copied as they are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]


def test_shorter_sides_become_s_and_small_images_are_copied(tmp_path):
    spec = importlib.util.spec_from_file_location("resize_folder", REPO / "benchmarks" / "resize_folder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(0)
    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.fromarray(rng.integers(0, 255, (60, 100, 3), dtype=np.uint8)).save(
        tmp_path / "src" / "a" / "wide.jpg"
    )
    Image.fromarray(rng.integers(0, 255, (30, 20, 3), dtype=np.uint8)).save(
        tmp_path / "src" / "a" / "small.png"
    )
    (tmp_path / "src" / "notes.txt").write_text("not an image")
    assert module.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--short-side", "32"]) == 2
    with Image.open(tmp_path / "dst" / "a" / "wide.jpg") as image:
        assert image.size == (53, 32) and image.format == "JPEG"
    small = (tmp_path / "dst" / "a" / "small.png").read_bytes()
    assert small == (tmp_path / "src" / "a" / "small.png").read_bytes()
    assert not (tmp_path / "dst" / "notes.txt").exists()
    with pytest.raises(SystemExit, match="exists"):
        module.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--short-side", "32"])
