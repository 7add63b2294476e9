"""``ssl-xcit visualize``: real PNGs and pages from the command, and one-line errors naming the bad value."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest
from PIL import Image

from ssl_xcit.cli import main
from ssl_xcit.models.base import Backbone

ARCH = ["--arch", "xcit_nano_12_p16", "--no-progress"]


def _not_blank(png):
    pixels = np.asarray(Image.open(png).convert("L"), dtype=np.float64)
    assert pixels.std() > 10, f"{png} looks blank (std {pixels.std():.1f})"
    return pixels.shape


def test_attention_at_a_high_resolution_with_html(shared_data, tmp_path):
    image = sorted((shared_data / "flowers5" / "sunflower").glob("*.jpg"))[0]
    png = main(
        ["visualize", "attention", *ARCH, "--size", "320", str(image), "--out", str(tmp_path), "--html"]
    )
    height, width = _not_blank(png)
    assert 150 < height < 400 and width > 4 * height  # one row: image, mean, 4 heads
    page = (tmp_path / "attention.html").read_text()
    inlined = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(inlined) == 1 and base64.b64decode(inlined[0]) == png.read_bytes()
    assert "http" not in page  # self-contained


def test_neighbours_command_leaves_queries_out_of_the_bank(shared_data, tmp_path):
    query = sorted((shared_data / "flowers5" / "rose").glob("*.jpg"))[0]
    png = main(
        [
            "visualize",
            "neighbours",
            *ARCH,
            "--train",
            str(shared_data / "flowers5"),
            "--per-class",
            "2",
            "--queries",
            str(query),
            "--k",
            "3",
            "--size",
            "32",
            "--out",
            str(tmp_path),
        ]
    )
    _not_blank(png)


def test_unreadable_image_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not a jpeg")
    for kind in ("pca", "attention"):
        with pytest.raises(SystemExit) as error:
            main(["visualize", kind, *ARCH, str(bad), "--out", str(tmp_path)])
        message = str(error.value.code)
        assert message.startswith(f"ssl-xcit visualize {kind}: cannot read image {bad}")
        assert "\n" not in message


def test_run_without_metrics_is_one_line_naming_it(tmp_path):
    with pytest.raises(SystemExit, match=f"^ssl-xcit visualize curves: no metrics.csv under {tmp_path}"):
        main(["visualize", "curves", str(tmp_path)])


class _Pooled(Backbone):
    family, name, size_multiple = "toy", "toy_pooled", 16


def test_backbone_without_attention_is_one_line_naming_it(monkeypatch, tmp_path):
    import ssl_xcit.cli.visualize as cli

    monkeypatch.setattr(cli, "_backbone", lambda args: _Pooled())
    with pytest.raises(SystemExit) as error:
        main(["visualize", "attention", *ARCH, "x.jpg", "--out", str(tmp_path)])
    message = str(error.value.code)
    assert message.startswith("ssl-xcit visualize attention: backbone toy_pooled (toy) has no attention maps")
    assert "\n" not in message


def test_unknown_kind_names_the_choices():
    with pytest.raises(SystemExit):
        main(["visualize", "tsne"])
