"""CI runs the linters before the suite, a hung test fails in minutes (pytest-timeout is configured), and
tests import nothing that only a local PYTHONPATH makes importable."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_has_a_timeout_of_minutes(pytestconfig):
    # pytest-timeout reads `timeout` from [tool.pytest.ini_options]; unset, it is 0 (no limit).
    timeout = float(pytestconfig.getini("timeout") or 0)
    assert 60 <= timeout <= 600, f"per-test timeout is {timeout} s"


def test_ci_runs_ruff_before_the_readme_test_command():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    install = commands.index('pip install -e ".[dev]"')
    check, fmt = commands.index("ruff check ."), commands.index("ruff format --check .")
    test = next(i for i, c in enumerate(commands) if re.fullmatch(r"pytest\b.*", c))
    assert install < check < test and install < fmt < test
    assert commands[test] == "pytest"  # the README's test command, exactly


def test_no_test_imports_the_tests_folder_as_a_package():
    # CI runs `pytest` with no PYTHONPATH: `tests` is not importable there (it has no __init__.py), so
    # `from tests.x import y` passes only on a machine whose environment puts the repository on the path.
    # pytest prepends each test file's folder, so helpers import by their module name.
    bad = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*(from|import)\s+tests(\.|\s|$)", line)
    ]
    assert not bad, f"imports of the `tests` package, which CI cannot import: {bad}"
