"""The invariant matrix from the command line: ``python tests/invariants/matrix.py --table invariants.md``.

Runs every row of the all-pairs designs (``matrix_options.full_design``: DDP's, then FSDP2's; ``--strategy
fsdp2,fsdp2_whole`` FSDP2's alone, ``--rows N`` the first N, ``--only ROW_ID,...`` named ones) on 2 gloo processes and its 1-process references (``matrix_worker``), checks them
(``matrix_checks``) and prints a Markdown table, one row per combination, one column per invariant; exit status 1
when any cell fails. ``--accelerator cuda`` runs the rows on a GPU (NCCL for 2 processes; with fewer than 2 GPUs
only the 1-process columns are meaningful, see ``--world 1``). Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import matrix_checks  # noqa: E402
import matrix_worker  # noqa: E402
from matrix_options import (  # noqa: E402, F401 (pairwise, fsdp2_design, expected_refusal: gpu_check_matrix.py)
    AXES,
    STRATEGIES,
    design,
    expected_refusal,
    fsdp2_design,
    full_design,
    pairwise,
    row_id,
    strategy,
)

TABLE_AXES = [*AXES, "strategy"]

WORKER = HERE / "matrix_worker.py"
ROW_TIMEOUT_S = (
    240  # a row's 2-process runs: 10-90 s on 2 cores shared with others (compiled rows the longest)
)


def _launch(out: Path, rows: list[dict], world: int, accelerator: str, in_process: bool = False) -> None:
    """The worker over ``rows``, in a fresh launch until each row has a result or has failed to give one:
    a rank that dies ends its launch (torchrun stops the other), and the rows after it run in the next."""
    fixtures = matrix_worker.dino_fixtures()
    # Rows with a result under ``out`` already (an interrupted matrix run again into the same --out) are kept.
    pending = [r for r in rows if not (out / row_id(r) / f"ws{world}_rank0.pt").exists()]
    while pending:
        spec = out / f"rows_ws{world}.json"
        spec.write_text(json.dumps(pending))
        args = [str(out), str(spec), str(world), accelerator]
        timeout = ROW_TIMEOUT_S * len(pending)
        try:
            if world > 1:
                fixtures.torchrun(WORKER, *args, timeout=timeout)
            elif in_process and all(strategy(r) == "ddp" for r in pending):
                # saves a second import of torch and Lightning (the default suite's row); FSDP2's 1-rank mesh
                # would leave a process group in this process
                matrix_worker.main(out, pending, 1, accelerator)
            else:
                subprocess.run([sys.executable, str(WORKER), *args], check=True, timeout=timeout,
                               capture_output=True)  # fmt: skip
        except (AssertionError, subprocess.SubprocessError) as err:
            print(
                f"launch ended early: {str(err).splitlines()[-1][:200] if str(err) else type(err)}",
                flush=True,
            )
        done = [r for r in pending if (out / row_id(r) / f"ws{world}_rank0.pt").exists()]
        if not done and pending:  # the first row gave nothing (a hang, a crash): record and go on
            done = pending[:1]
        pending = [r for r in pending if r not in done]


def run_matrix(
    rows: list[dict],
    out: Path,
    accelerator: str = "cpu",
    worlds: tuple[int, ...] = (2, 1),
    in_process: bool = False,
) -> list:
    """Every run of ``rows`` under ``out``; the per-row results of ``matrix_checks``. ``in_process``: the
    1-process runs in this process (rows without compile: dynamo's state would stay in it)."""
    out.mkdir(parents=True, exist_ok=True)
    for world in worlds:
        _launch(out, rows, world, accelerator, in_process)
    return [matrix_checks.results_for(out, r, row_id(r), matrix_worker.WINDOWS, 2 in worlds) for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--rows", type=int, default=None, help="only the first N rows of the design")
    parser.add_argument("--only", default="", help="comma-separated row ids")
    parser.add_argument(
        "--strategy", default=",".join(STRATEGIES), help="comma-separated: ddp,fsdp2,fsdp2_whole"
    )
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--world", type=int, nargs="+", default=[2, 1], help="process counts to run (2 1)")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--check-only", action="store_true", help="check the runs under --out, run none")
    args = parser.parse_args(argv)
    rows = full_design(tuple(args.strategy.split(",")))
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if row_id(r) in wanted]
    rows = rows[: args.rows] if args.rows else rows
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out, worlds = args.out or Path(tmp), tuple(sorted(args.world, reverse=True))
        if args.check_only:
            windows = matrix_worker.WINDOWS
            results = [matrix_checks.results_for(out, r, row_id(r), windows, 2 in worlds) for r in rows]
        else:
            results = run_matrix(rows, out, args.accelerator, worlds)
    text = matrix_checks.table(rows, results, TABLE_AXES)
    refusals = {d for r in results for s, d in r.values() if s == matrix_checks.REFUSED}
    text += "".join(f"\n\nrefused: {d}" for d in sorted(refusals))
    minutes = (time.perf_counter() - start) / 60
    print(text)
    print(f"\n{len(rows)} rows in {minutes:.1f} min")
    if args.table:
        args.table.write_text(text + "\n")
    return 1 if any(s == matrix_checks.FAIL for r in results for s, _ in r.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
