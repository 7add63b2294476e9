from __future__ import annotations

import subprocess
import sys

import pytest

from ssl_xcit.cli import COMMANDS, main


def test_unknown_command_lists_the_valid_ones():
    with pytest.raises(SystemExit, match="unknown command 'trian'; valid commands: fit, validate"):
        main(["trian"])


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_models_lists_a_family_with_params_and_gmacs(capsys):
    rows = main(["models", "--family", "vit"])
    assert [r["name"] for r in rows][:3] == [
        "vit_tiny_patch16_224",
        "vit_small_patch16_224",
        "vit_small_patch8_224",
    ]
    small = rows[1]
    # ViT-S/16: 21.67M parameters without head, 4.6 GMACs at 224 (DINO paper Table 2 / timm).
    assert (small["params_millions"], small["gmacs_224"], small["family"]) == (21.67, 4.6, "vit")
    assert "vit_small_patch16_224" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name,params,gmacs",
    [("cait_xxs24", 11.76, 2.53), ("cait_s24", 46.53, 9.35), ("xcit_small_12_p16", 25.87, 4.8)],
)
def test_models_table_numbers_match_the_references(name, params, gmacs):
    from ssl_xcit.cli.models import table_row

    row = table_row(name)
    assert row["params_millions"] == params
    assert abs(row["gmacs_224"] - gmacs) / gmacs < 0.01  # backbones.md §0 (fvcore) / XCiT Table 1


def test_every_family_is_listed():
    from ssl_xcit.models import list_families, list_models

    assert {"xcit", "cait", "vit"} <= set(list_families())
    assert len(list_models("xcit")) == 14 and len(list_models("cait")) == 10


def test_models_summary_runs_a_forward():
    summary = main(["models", "xcit_nano_12_p8", "--input-size", "48", "64"])
    assert summary["dense_grid"] == [6, 8] and summary["dense_tokens"] == [1, 48, 128]
    assert summary["embedding"] == [1, 128] and summary["params_millions"] == 2.92


def test_models_summary_rejects_a_size_with_the_constraint():
    with pytest.raises(ValueError, match="input size 50x64 .*multiples of 8"):
        main(["models", "xcit_nano_12_p8", "--input-size", "50", "64"])


def test_every_command_module_exists():
    import importlib

    for module, function in set(COMMANDS.values()):
        assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.slow  # a fresh interpreter importing torch (~10 s); the console-script tests cover dispatch
def test_python_dash_m_exits_zero():
    out = subprocess.run(
        [sys.executable, "-m", "ssl_xcit", "models", "xcit_nano_12_p16", "--input-size", "32", "32"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "embedding              [1, 128]" in out.stdout


# Both scripts are one declared entry point; each run starts an interpreter that imports Lightning (~6 s). By
# default test_lightning_console_script_dispatches_to_our_cli runs that entry point on the same recipe, and
# test_no_installed_distribution_takes_the_lightning_script_from_us checks who owns the installed script.
@pytest.mark.slow
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


def _declared_scripts() -> dict[str, str]:
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # standard library from Python 3.11
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["scripts"]


def test_lightning_console_script_dispatches_to_our_cli():
    """`lightning fit -c recipes/...` (the spelling the product is known by) is our CLI, installed or not: the
    declared entry point is loaded and called exactly as pip's generated script calls it."""
    from pathlib import Path

    scripts = _declared_scripts()
    assert scripts["lightning"] == scripts["ssl-xcit"] == "ssl_xcit.cli:console_main"
    launcher = (
        "import sys\n"
        "from importlib.metadata import EntryPoint\n"
        f"entry = EntryPoint(name='lightning', value={scripts['lightning']!r}, group='console_scripts').load()\n"
        "sys.argv[0] = 'lightning'\n"
        "sys.exit(entry())\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", launcher, "fit", "-c", "recipes/dino_xcit_s12_8.yaml", "--print_config"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backbone: xcit_small_12_p8" in out.stdout
    assert "class_path: ssl_xcit.dino.module.DINO" in out.stdout


def test_no_installed_distribution_takes_the_lightning_script_from_us():
    """Another package's `lightning` script (lightning-sdk ships one) would shadow ours on PATH, depending on
    install order. Every installed `lightning` console script must be ours."""
    from importlib.metadata import distributions

    owners = {
        (dist.metadata["Name"], ep.value)
        for dist in distributions()
        for ep in dist.entry_points
        if ep.group == "console_scripts" and ep.name == "lightning"
    }
    assert owners <= {("ssl-xcit", "ssl_xcit.cli:console_main")}, owners


@pytest.mark.parametrize("command", ["test", "predict"])
def test_unimplemented_lightning_subcommands_are_not_offered(command, capsys):
    with pytest.raises(
        SystemExit, match=rf"unknown command '{command}'; valid commands: fit, validate, export"
    ):
        main([command, "-c", "recipes/quickstart.yaml"])
