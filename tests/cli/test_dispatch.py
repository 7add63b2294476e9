from __future__ import annotations

import subprocess
import sys

import pytest

from ssl_xcit.cli import COMMANDS, main


def test_unknown_command_lists_the_valid_ones():
    with pytest.raises(SystemExit, match="unknown command 'trian'; valid commands: fit, validate"):
        main(["trian"])


def test_models_lists_all_variants(capsys):
    names = main(["models"])
    assert len(names) == 14
    assert "xcit_small_12_p16        25.87M params" in capsys.readouterr().out


def test_models_summary_runs_a_forward():
    summary = main(["models", "xcit_nano_12_p8", "--input-size", "48", "64"])
    assert summary["patch_grid"] == [6, 8] and summary["patch_tokens"] == [1, 48, 128]
    assert summary["cls_embedding"] == [1, 128] and summary["params_millions"] == 2.92


def test_every_command_module_exists():
    import importlib

    for module, function in set(COMMANDS.values()):
        assert callable(getattr(importlib.import_module(module), function))


def test_python_dash_m_exits_zero():
    out = subprocess.run(
        [sys.executable, "-m", "ssl_xcit", "models", "xcit_nano_12_p16", "--input-size", "32", "32"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "cls_embedding          [1, 128]" in out.stdout


@pytest.mark.parametrize("script", ["lightning", "ssl-xcit"])
def test_console_scripts_parse_a_recipe_exactly_as_typed(script):
    import shutil
    from pathlib import Path

    exe = shutil.which(script) or str(Path(sys.executable).with_name(script))
    if not Path(exe).exists():
        pytest.skip(f"console script {script!r} is not installed (pip install -e .)")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [exe, "fit", "-c", "recipes/dino_xcit_s12_8.yaml", "--print_config"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backbone: xcit_small_12_p8" in out.stdout
