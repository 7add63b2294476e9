"""``killed_prepare(KILL_AT, SRC, OUT, **KWARGS)``: ``prepare_shards(SRC, OUT, **KWARGS)`` in a forked process that kills its whole process
group (itself and LitData's workers, as a scheduler's kill does) when a worker reaches listing index ``KILL_AT``.

Forked rather than started afresh: a new interpreter spends most of the test importing torch and LitData."""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

from ssl_xcit.data import shards


def _run(kill_at: int, src: str, out: str, kwargs: dict[str, Any]) -> None:
    os.setsid()  # a process group of its own, so that the kill spares the test
    write = shards._RecordWriter.__call__

    def write_or_die(self, index: int):
        if index == kill_at:
            os.killpg(0, signal.SIGKILL)
        return write(self, index)

    shards._RecordWriter.__call__ = write_or_die
    shards.prepare_shards(src, out, **kwargs)


def killed_prepare(kill_at: int, src: str, out: str, timeout: float = 120, **kwargs: Any) -> int | None:
    """Run the killed ``prepare``; its exit code (``-9`` when it was killed)."""
    process = multiprocessing.get_context("fork").Process(target=_run, args=(kill_at, src, out, kwargs))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.join()
    return process.exitcode
