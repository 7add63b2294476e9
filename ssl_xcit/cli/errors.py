"""Short error messages for the mistakes users make, full tracebacks on request.

An expected error (a missing path, a bad value, an unknown model or key) ends the command with one or two
lines on stderr: what is wrong, the bad value and what would be valid, and exit status 2. ``--traceback``
(anywhere on the command line) or ``SSL_XCIT_TRACEBACK=1`` shows the full traceback instead.

Expected errors are the toolkit's own :class:`~ssl_xcit.errors.UserError` (and ``TrainingDiverged``) and the
library errors that only bad input causes (:data:`USER_ERRORS`). Anything else, a plain ``ValueError`` from
torch included, is a bug and keeps its traceback and Python's exit status 1.
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

from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser
from PIL import UnidentifiedImageError

from ssl_xcit.errors import TrainingDiverged, UserError

TRACEBACK_ENV = "SSL_XCIT_TRACEBACK"
TRACEBACK_FLAG = "--traceback"
EXIT_USER_ERROR = 2
# Errors only bad input causes: ours (each message names the value and what is valid), a path the user gave
# that is missing or not writable, and the libraries' own reports of a bad setting or file.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError,
    TrainingDiverged,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
    PermissionError,
    UnidentifiedImageError,  # PIL: a file given as an image is not one
    ArgumentError,  # jsonargparse: a value the config or command line cannot take
    MisconfigurationException,  # Lightning's own "this Trainer setting cannot work"
)
HINT = f"(add {TRACEBACK_FLAG} or set {TRACEBACK_ENV}=1 for the full traceback)"


def traceback_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether the full traceback is wanted, and ``argv`` without the ``--traceback`` flag."""
    wanted = TRACEBACK_FLAG in argv or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
    return wanted, [a for a in argv if a != TRACEBACK_FLAG]


def _raised_in_jsonargparse(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("jsonargparse")


def user_error(err: BaseException) -> BaseException | None:
    """The expected error that ``err`` reports, or None when it is a bug (which then keeps its traceback).

    jsonargparse re-raises whatever a configured class's ``__init__`` raised as its own ``ValueError`` "from"
    it, so an error raised inside jsonargparse with a cause is judged by that cause. Any other error is judged
    by itself: a bug raised while handling a missing file is still a bug.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if cause is not None and _raised_in_jsonargparse(err):
            err = cause
            continue
        return err if isinstance(err, USER_ERRORS) else None
    return None


# torch re-raises an error of a DataLoader worker (or its pin-memory thread) as the same type whose message
# is this line followed by the worker's traceback, which ends with "module.Type: the original message".
_WORKER_WRAPPED = re.compile(r"Caught (\w+) in (DataLoader worker process \d+|pin memory thread)")


def short_message(err: BaseException) -> str:
    """The first line of ``err``'s message (jsonargparse appends the whole parsed namespace after it); for an
    error re-raised from a DataLoader worker, the first line of the worker's own message."""
    text = str(err).strip() or type(err).__name__
    if isinstance(err, KeyError) and len(err.args) == 1:
        text = str(err.args[0])
    wrapped = _WORKER_WRAPPED.match(text)
    if wrapped:
        name = re.escape(wrapped.group(1))
        original = list(re.finditer(rf"^(?:[\w.]+\.)?{name}: (.+)$", text, flags=re.MULTILINE))
        if original:
            return original[-1].group(1).strip()
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
