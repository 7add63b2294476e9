"""Short error messages for the mistakes users make, full tracebacks on request.

An expected error (a missing path, a bad value, an unknown model or key) ends the command with one or two
lines on stderr: what is wrong, the bad value and what would be valid, and exit status 2. ``--traceback``
(anywhere on the command line) or ``SSL_XCIT_TRACEBACK=1`` shows the full traceback instead. Anything else
(a bug) keeps its traceback.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterable
from typing import NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser

TRACEBACK_ENV = "SSL_XCIT_TRACEBACK"
TRACEBACK_FLAG = "--traceback"
EXIT_USER_ERROR = 2
# Errors our code raises for bad input (each message names the value and what is valid).
USER_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
    PermissionError,
    ValueError,
    FloatingPointError,
    MisconfigurationException,  # Lightning's own "this Trainer setting cannot work"
)
HINT = f"(add {TRACEBACK_FLAG} or set {TRACEBACK_ENV}=1 for the full traceback)"


def traceback_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether the full traceback is wanted, and ``argv`` without the ``--traceback`` flag."""
    wanted = TRACEBACK_FLAG in argv or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
    return wanted, [a for a in argv if a != TRACEBACK_FLAG]


def user_error(err: BaseException) -> BaseException | None:
    """The innermost expected error in ``err``'s cause chain (jsonargparse wraps the real one), or None."""
    found = None
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, USER_ERRORS):
            found = err
        err = err.__cause__ or err.__context__
    return found


def short_message(err: BaseException) -> str:
    """The first line of ``err``'s message (jsonargparse appends the whole parsed namespace after it)."""
    text = str(err).strip() or type(err).__name__
    if isinstance(err, KeyError) and len(err.args) == 1:
        text = str(err.args[0])
    return text.splitlines()[0]


def report(command: str, err: BaseException) -> NoReturn:
    """Print ``ssl-xcit COMMAND: error: ...`` and the traceback hint, then exit with status 2."""
    sys.stderr.write(f"ssl-xcit {command}: error: {short_message(err)}\n{HINT}\n")
    raise SystemExit(EXIT_USER_ERROR)


# ----------------------------------------------------------------------------------- config key typos
_UNKNOWN_KEY = (
    re.compile(r"Option '([\w.]+)' is not accepted"),
    re.compile(r'Key "([\w.]+)" is not expected'),
    re.compile(r'No action for key "([\w.]+)"'),
    re.compile(r"Unrecognized arguments: (--[\w.]+)"),
)
_CLASS_PATH = re.compile(r"class_path '([\w.]+)'")


def _signature_names(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def suggest_key(message: str, option_strings: Iterable[str]) -> str | None:
    """``"did you mean `X`?"`` for the unknown key in a jsonargparse ``message``, or None."""
    bad = next((m.group(1) for pattern in _UNKNOWN_KEY if (m := pattern.search(message))), None)
    if bad is None:
        return None
    leaf = bad.lstrip("-").split(".")[-1]
    names = {o.lstrip("-").split(".")[-1] for o in option_strings}
    for class_path in _CLASS_PATH.findall(message):
        names.update(_signature_names(class_path))
    close = difflib.get_close_matches(leaf, sorted(names - {leaf}), n=1, cutoff=0.6)
    return f"unknown key `{leaf}`: did you mean `{close[0]}`?" if close else f"unknown key `{leaf}`"


class ShortErrorParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are two lines (the cause and a suggestion) instead of the usage and
    the whole parsed namespace. ``--traceback``/``SSL_XCIT_TRACEBACK=1`` keeps jsonargparse's full report."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if traceback_requested(sys.argv)[0] or not self.exit_on_error:
            super().error(message, ex)
        options = [o for action in self._actions for o in action.option_strings]
        suggestion = suggest_key(message, options)
        cause = user_error(ex) if ex is not None else None
        if suggestion is None and cause is not None and not isinstance(cause, type(ex)):
            first = short_message(cause)  # the real error under jsonargparse's "Does not validate" wrapper
        else:
            first = _most_specific_line(message)
        # "__main__.py fit" or "lightning fit" -> "ssl-xcit fit": the name users type
        prog = " ".join(["ssl-xcit", *self.prog.replace(" [options]", "").split()[1:]])
        lines = [f"{prog}: error: {first}"] + ([suggestion] if suggestion and suggestion not in first else [])
        sys.stderr.write("\n".join(lines) + f"\n{HINT}\n")
        raise SystemExit(EXIT_USER_ERROR)


def _most_specific_line(message: str) -> str:
    for pattern in _UNKNOWN_KEY:
        if m := pattern.search(message):
            return m.group(0)
    lines = [line.strip(" -") for line in message.splitlines() if line.strip()]
    # jsonargparse lists the failed union members; the first non-boilerplate one is the reason.
    for line in lines:
        if not line.startswith(
            ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Given value", "Expected a")
        ):
            return line
    return lines[0] if lines else message
