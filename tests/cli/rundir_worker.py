"""One process of a launched run choosing its run folder: ``python rundir_worker.py ROOT OUT SUBCOMMAND [CKPT]``.

Started by torchrun or with SLURM's variables set, it resolves the folder exactly as ``ssl-xcit fit`` does
before any class is built (``inherited_run_dir`` + ``place_run``) and writes ``{"run", "ckpt_path", "error"}``
to ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jsonargparse import Namespace

from ssl_xcit.cli.rundir import inherited_run_dir, place_run


def main(root: str, out: str, subcommand: str, ckpt_path: str | None = None) -> None:
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    config = Namespace(
        trainer=Namespace(default_root_dir=root, logger=None, callbacks=None), ckpt_path=ckpt_path
    )
    result = {"run": None, "ckpt_path": None, "error": None}
    try:
        run, _ = place_run(config, subcommand, None, inherited_run_dir())
        result.update(run=str(run), ckpt_path=config.ckpt_path)
    except FileNotFoundError as err:
        result["error"] = str(err)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
