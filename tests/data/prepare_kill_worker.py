"""``python prepare_kill_worker.py KILL_AT ARGS...``: ``ssl-xcit prepare ARGS`` that kills its whole process group
(itself and LitData's workers, as a scheduler's kill does) when a worker reaches listing index ``KILL_AT``."""

from __future__ import annotations

import os
import signal
import sys

from ssl_xcit.cli import main
from ssl_xcit.data import shards

KILL_AT = int(sys.argv[1])
_write = shards._RecordWriter.__call__


def _write_or_die(self, index: int):
    if index == KILL_AT:
        os.killpg(0, signal.SIGKILL)
    return _write(self, index)


shards._RecordWriter.__call__ = _write_or_die

if __name__ == "__main__":
    main(sys.argv[2:])
