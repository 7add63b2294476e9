"""Bad inputs to ``ssl-xcit knn`` / ``ssl-xcit linear`` fail early with errors that name the bad value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ssl_xcit.cli import main
from ssl_xcit.models import create_model

from .helpers import ARCH, small_args

COMMANDS = [["knn"], ["linear", "--fast"], ["linear"]]


def _tree(root: Path, classes: list[str], source: Path, per_class: int = 2) -> Path:
    images = sorted((source / "daisy").iterdir())
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            os.symlink(images[i], root / c / f"{i}.jpg")
    return root


@pytest.fixture
def shared_flowers(shared_data: Path) -> Path:
    return shared_data / "flowers5"


@pytest.mark.parametrize("command", COMMANDS)
def test_class_sets_differ(command, shared_flowers, tmp_path):
    train = _tree(tmp_path / "train", ["a", "b", "c"], shared_flowers)
    val = _tree(tmp_path / "val", ["a", "b", "d"], shared_flowers)
    with pytest.raises(ValueError, match=r"only in train: \['c'\]; only in val: \['d'\]"):
        main([*command, *small_args(train, val, tmp_path / "cache")])


@pytest.mark.parametrize("command", COMMANDS)
def test_empty_split(command, shared_flowers, tmp_path):
    train = _tree(tmp_path / "train", ["a", "b"], shared_flowers)
    val = tmp_path / "val"
    val.mkdir()
    with pytest.raises(ValueError, match=r"data folder .*val is empty"):
        main([*command, *small_args(train, val, tmp_path / "cache")])
    (val / "a").mkdir()  # class folders without a single image
    with pytest.raises(ValueError, match=r"no images found in .*val"):
        main([*command, *small_args(train, val, tmp_path / "cache")])


@pytest.mark.parametrize("command", COMMANDS)
def test_checkpoint_of_another_architecture(command, shared_flowers, tmp_path):
    train = _tree(tmp_path / "train", ["a", "b"], shared_flowers)
    weights = tmp_path / "nano.pth"
    torch.save(create_model(ARCH).state_dict(), weights)
    args = [*command, *small_args(train, train, tmp_path / "cache"), "--weights", str(weights)]
    args[args.index("--arch") + 1] = "xcit_tiny_12_p16"
    with pytest.raises(
        ValueError, match=r"holds a xcit_nano_12_p16 backbone, but xcit_tiny_12_p16 was requested"
    ):
        main(args)


@pytest.mark.parametrize("command", COMMANDS)
def test_missing_weights_file(command, shared_flowers, tmp_path):
    train = _tree(tmp_path / "train", ["a", "b"], shared_flowers)
    missing = tmp_path / "no_such_checkpoint.pth"
    with pytest.raises(FileNotFoundError, match=r"weights file not found: .*no_such_checkpoint.pth"):
        main([*command, *small_args(train, train, tmp_path / "cache"), "--weights", str(missing)])


def test_no_weights_and_no_arch(shared_flowers, tmp_path):
    train = _tree(tmp_path / "train", ["a", "b"], shared_flowers)
    args = small_args(train, train, tmp_path / "cache")
    i = args.index("--arch")
    del args[i : i + 2]
    with pytest.raises(ValueError, match="give --weights, or --arch NAME"):
        main(["knn", *args])


def test_unknown_backend_is_rejected_by_the_parser(shared_flowers, tmp_path, capsys):
    train = _tree(tmp_path / "train", ["a", "b"], shared_flowers)
    with pytest.raises(SystemExit):
        main(["knn", *small_args(train, train, tmp_path / "cache"), "--backend", "annoy"])
    err = capsys.readouterr().err
    assert "argument --backend: invalid choice: 'annoy'" in err and "torch" in err and "faiss" in err
