"""One process of a launched run choosing its run folder:
``python rundir_worker.py ROOT OUT SUBCOMMAND [CKPT [NUM_NODES]]``.

Started by torchrun or with a launcher's variables set (SLURM, MPI, WORLD_SIZE/RANK), it resolves the folder exactly as ``ssl-xcit fit`` does
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


def main(root: str, out: str, subcommand: str, ckpt_path: str = "", num_nodes: str = "1") -> None:
    names = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "NODE_RANK")
    rank = next((os.environ[n] for n in names if n in os.environ), "0")
    trainer = Namespace(default_root_dir=root, logger=None, callbacks=None, num_nodes=int(num_nodes))
    config = Namespace(trainer=trainer, ckpt_path=ckpt_path or None)
    result = {"run": None, "ckpt_path": None, "error": None}
    try:
        run, _ = place_run(config, subcommand, None, inherited_run_dir())
        result.update(run=str(run), ckpt_path=config.ckpt_path)
    except FileNotFoundError as err:
        result["error"] = str(err)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
