"""Constants and the image decoder are defined once, in ``ssl_xcit.data``; other packages import them."""

from __future__ import annotations

import re
from pathlib import Path

import ssl_xcit

PACKAGE = Path(ssl_xcit.__file__).parent


def definitions(pattern: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in path.read_text().splitlines():
            if re.match(pattern, line):
                found.append(path.relative_to(PACKAGE).as_posix())
    return found


def test_imagenet_statistics_extensions_and_decoder_defined_once():
    assert definitions(r"IMAGENET_MEAN\s*=") == ["data/transforms.py"]
    assert definitions(r"IMAGENET_STD\s*=") == ["data/transforms.py"]
    assert definitions(r"""\w+\s*=\s*\(\s*["']\.jpg["']""") == ["data/folders.py"]
    assert definitions(r"def load_image\(") == ["data/image_dataset.py"]


def test_retrieval_uses_the_data_definitions():
    from ssl_xcit.data import datasets, transforms
    from ssl_xcit.retrieval import images

    assert images.IMAGENET_MEAN is transforms.IMAGENET_MEAN and images.load_image is datasets.load_image
