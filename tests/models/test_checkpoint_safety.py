"""Opening a checkpoint never runs code unless the user says they trust the file (issue 19, item 7)."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest
import torch

from ssl_xcit.cli import main as cli_main
from ssl_xcit.models import build_backbone, create_model, read_checkpoint
from ssl_xcit.models import safe_load as checkpoint_module  # where --trust-checkpoint is recorded


class _SideEffect:
    """Unpickling this creates ``marker``: stands in for any code a malicious checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _malicious(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    model = create_model("xcit_nano_12_p16", depth=1)
    torch.save({"state_dict": model.state_dict(), "payload": _SideEffect(marker)}, path, pickle_protocol=2)
    return path, marker


def test_a_crafted_pickle_does_not_run_by_default(tmp_path):
    path, marker = _malicious(tmp_path)
    with pytest.raises(ValueError, match=r"refusing to unpickle checkpoint .*evil\.pth.*--trust-checkpoint"):
        read_checkpoint(path)
    with pytest.raises(ValueError, match="--trust-checkpoint"):
        build_backbone(path, "xcit_nano_12_p16", depth=1)
    assert not marker.exists()


def test_trust_unpickles_fully_with_a_warning(tmp_path):
    path, marker = _malicious(tmp_path)
    with pytest.warns(UserWarning, match="full unpickler"):
        read_checkpoint(path, trust=True)
    assert marker.exists()


def test_the_cli_flag_trusts_only_the_command_that_names_it(tmp_path, monkeypatch):
    path, marker = _malicious(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):  # a one-line usage error
        cli_main(["export", str(path), "out.pth"])
    assert not marker.exists() and not checkpoint_module.TRUST_FROM_CLI
    with pytest.raises(SystemExit):  # trusted, but this file records no backbone: the unpickle itself ran
        cli_main(["export", str(path), "out.pth", "--trust-checkpoint"])
    assert marker.exists()
    marker.unlink()
    with pytest.raises(SystemExit):  # a later command without the flag is untrusted again
        cli_main(["export", str(path), "out.pth"])
    assert not marker.exists() and not checkpoint_module.TRUST_FROM_CLI


def test_official_dino_layout_with_argparse_namespace_loads_without_trust(tmp_path):
    model = create_model("xcit_nano_12_p16", depth=1)
    path = tmp_path / "dino_official.pth"
    args = argparse.Namespace(arch="xcit_nano_12_p16", patch_size=16, out_dim=65536, lr=0.0005)
    state = {f"backbone.{k}": v for k, v in model.state_dict().items()}
    torch.save({"teacher": state, "student": state, "args": args, "epoch": 300}, path)
    loaded = read_checkpoint(path)
    assert loaded["args"].arch == "xcit_nano_12_p16"
    rebuilt = build_backbone(path, "xcit_nano_12_p16", depth=1)
    for key, value in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value)


def test_plain_pickle_of_a_function_is_refused(tmp_path):
    path = tmp_path / "fn.pth"
    path.write_bytes(pickle.dumps({"hook": print}))
    with pytest.raises(ValueError, match=r"cannot read checkpoint .*fn\.pth.*--trust-checkpoint"):
        read_checkpoint(path)


def test_checkpoint_and_sharded_readers_do_not_import_each_other():
    """Issue 52 item 8: ``models/checkpoint.py`` and ``models/sharded.py`` imported each other (inside
    functions); both now build on ``models/safe_load.py``, and sharded.py names nothing of checkpoint.py."""
    import ast

    root = Path(__file__).resolve().parents[2] / "ssl_xcit" / "models"
    for module, other in (("sharded", "checkpoint"), ("safe_load", "checkpoint"), ("safe_load", "sharded")):
        tree = ast.parse((root / f"{module}.py").read_text())
        imported = {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        } | {
            f"{node.module}.{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
        assert f"ssl_xcit.models.{other}" not in imported, (module, other)
