"""CI runs the linters before the suite, and a hung test fails in minutes (pytest-timeout is configured)."""

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
