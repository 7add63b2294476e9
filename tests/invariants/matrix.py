"""The invariant matrix from the command line: ``python tests/invariants/matrix.py --docs docs/invariants.md``.

Runs every row of the all-pairs designs (``matrix_options.full_design``: DDP's, then FSDP2's; ``--strategy
fsdp2,fsdp2_whole`` FSDP2's alone, ``--rows N`` the first N, ``--only ROW_ID,...`` named ones) on 2 gloo processes and its 1-process references (``matrix_worker``), checks them
(``matrix_checks``) and prints a Markdown table, one row per combination, one column per invariant; exit status 1
when any cell fails. ``--mutants`` runs the seeded defects of ``mutants.py`` instead (``--mutants NAME,...``
some), each in every precision, and prints which cell kills each; exit status 1 when one survives. ``--docs
FILE`` writes the tables into FILE between their markers (docs/invariants.md), so the page is the code's output.
``--accelerator cuda`` runs the rows on a GPU (NCCL for 2 processes; with fewer than 2 GPUs only the 1-process
columns are meaningful, see ``--world 1``). Run from the repository root.
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
import mutants  # noqa: E402
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

TABLE_AXES = [*AXES, "scaler", "strategy"]

WORKER = HERE / "matrix_worker.py"
# A row's 2-process runs: 10-90 s on 2 cores shared with others (compiled rows the longest); inductor's compile
# takes minutes more, and those rows get three times as long.
ROW_TIMEOUT_S = 240


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
        timeout = sum(ROW_TIMEOUT_S * (3 if r["compile"] == "inductor" else 1) for r in pending)
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


def mutant_results(
    names: list[str], out: Path, accelerator: str = "cpu", precisions: tuple[str, ...] = mutants.PRECISIONS
) -> dict[str, list[tuple[str, str]]]:
    """Each mutant's rows (``mutants.rows``, those of ``precisions``) run with the defect seeded; per precision
    ``(status, cell)``: ``killed`` and the first failing column with its detail, ``equivalent`` (a
    GradScaler-only defect outside 16-mixed whose runs equal the unmutated row's bit for bit), or ``SURVIVED``."""
    found: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        rows = [r for r in mutants.rows(name) if r["precision"] in precisions]
        with mutants.environment(name):
            results = run_matrix(rows, out / name, accelerator)
        cells = []
        for row, result in zip(rows, results, strict=True):
            failed = [(c, d) for c, (s, d) in result.items() if s == matrix_checks.FAIL]
            if mutants.MUTANTS[name].scaler_only and row["precision"] != "16-mixed":
                run_matrix([row], out / "unmutated", accelerator)  # its runs, on disk: compared below
                same = matrix_checks.same_runs(out / name / row_id(row), out / "unmutated" / row_id(row))
                cells.append(("equivalent", "no GradScaler: " + same) if not same.startswith("FAIL")
                             else ("SURVIVED", same))  # fmt: skip
            elif len(failed) == len(result) and len({d for _, d in failed}) == 1:  # the row's runs stopped
                cells.append(("killed", f"every cell: the run stopped ({failed[0][1]})"))
            elif failed:
                column, detail = failed[0]
                cells.append(("killed", f"{column} ({detail})"))
            else:
                cells.append(("SURVIVED", "every cell passed"))
        found[name] = cells
        print(
            f"{name}: "
            + "; ".join(f"{r['precision']} {s} {c}" for r, (s, c) in zip(rows, cells, strict=True)),
            flush=True,
        )
    return found


def mutant_table(found: dict[str, list[tuple[str, str]]]) -> str:
    """Markdown: one row per mutant, one column per precision, the killing cell in each."""
    lines = [
        "| mutant | defect | " + " | ".join(mutants.PRECISIONS) + " |",
        "|" + "---|" * (2 + len(mutants.PRECISIONS)),
    ]
    for name, cells in found.items():
        text = [f"{s}: {c}".replace("|", "/") if s != "killed" else c.replace("|", "/") for s, c in cells]
        lines.append(f"| `{name}` | {mutants.MUTANTS[name].what} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def write_docs(path: Path, section: str, text: str, command: str) -> None:
    """Replace the text between ``<!-- matrix:SECTION -->`` and ``<!-- /matrix:SECTION -->`` in ``path``."""
    start, end = f"<!-- matrix:{section} -->", f"<!-- /matrix:{section} -->"
    page = path.read_text()
    if start not in page or end not in page:
        raise SystemExit(f"{path} has no {start} ... {end} markers")
    head, rest = page.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{command}\n\n{text}\n{end}{tail}")


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
    parser.add_argument("--mutants", nargs="?", const=",".join(mutants.MUTANTS), default=None,
                        help="run the seeded defects (comma-separated names; all by default) instead")  # fmt: skip
    parser.add_argument("--docs", type=Path, help="write the tables into this page between their markers")
    args = parser.parse_args(argv)
    if args.mutants is not None:
        with tempfile.TemporaryDirectory() as tmp:
            out = (args.out or Path(tmp)) / "mutants"
            found = mutant_results(args.mutants.split(","), out, args.accelerator)
            minutes = run_minutes(out)
        text = mutant_table(found)
        print(text + f"\n\n{len(found)} mutants in {minutes:.1f} min")
        if args.docs:
            write_docs(args.docs, "mutants", text, _stamp("--mutants", minutes))
        return 1 if any(s == "SURVIVED" for cells in found.values() for s, _ in cells) else 0
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
        minutes = max(run_minutes(out), (time.perf_counter() - start) / 60)
    text = matrix_checks.table(rows, results, TABLE_AXES)
    refusals = {d for r in results for s, d in r.values() if s == matrix_checks.REFUSED}
    text += "".join(f"\n\nrefused: {d}" for d in sorted(refusals))
    print(text)
    print(f"\n{len(rows)} rows in {minutes:.1f} min")
    if args.table:
        args.table.write_text(text + "\n")
    if args.docs:
        write_docs(args.docs, "+".join(sorted(set(args.strategy.split(",")))), text,
                   _stamp(f"--strategy {args.strategy}", minutes))  # fmt: skip
    return 1 if any(s == matrix_checks.FAIL for r in results for s, _ in r.values()) else 0


def run_minutes(out: Path) -> float:
    """The launches' time of the runs under ``out`` (each ``timings.txt`` line: ``ROW wsN: T s``), so a table
    checked again from kept runs (``--out``) states how long they took to make."""
    lines = [line for f in out.rglob("timings.txt") for line in f.read_text().splitlines()]
    return sum(float(line.rsplit(":", 1)[1].split()[0]) for line in lines if ":" in line) / 60


def _stamp(flags: str, minutes: float) -> str:
    """The line above a generated table: its command, machine, date and the runs' time."""
    import os
    import platform

    import torch

    return (
        f"Generated by `python tests/invariants/matrix.py {flags} --docs docs/invariants.md` on "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
        f"runs of {minutes:.1f} min."
    )


if __name__ == "__main__":
    sys.exit(main())
