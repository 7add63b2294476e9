"""The invariant matrix (issue 42): real ``fit`` steps on 1 and 2 gloo processes over an all-pairs design of the
training options, each run checked for the invariants of ``matrix_checks`` (docs/invariants.md)."""

from __future__ import annotations

import math
from pathlib import Path

import matrix_checks as checks
import matrix_worker
import pytest
import torch
from matrix import TABLE_AXES, mutant_results, run_matrix
from matrix_options import (
    AXES,
    FSDP2_AXES,
    OPTIM_ROWS,
    REFUSALS,
    covered,
    design,
    expected_refusal,
    fsdp2_design,
    full_design,
    pairwise,
    row_id,
    setting,
)
from mutants import MUTANTS, PRECISIONS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "invariants.md"

# The default suite's row: issue 42's first silent error (rank 1's last micro-batch of a window unreadable under
# DDP accumulation: the ranks drift apart), with XCiT's synced BatchNorm and the fused optimiser. The 16-mixed
# errors (a clip of scaled gradients, the scaler's read per step) are rows of the whole matrix.
FAST_ROW = {"accumulate": "2", "unreadable": "one_rank", "precision": "32-true", "optimizer": "fused",
            "norm": "xcit_syncbn", "objective": "dino", "compile": "off"}  # fmt: skip


def test_the_design_covers_every_pair_and_is_deterministic():
    rows = pairwise(AXES)
    assert covered(rows) and rows == pairwise(AXES)
    assert not covered(rows[:-1])  # each row adds a pair
    largest = sorted(len(v) for v in AXES.values())[-2:]
    assert math.prod(largest) <= len(rows) <= 40  # the lower bound of any pairwise design, and small
    # A new axis is one line, and the design still covers it.
    grown = {**AXES, "strategy": ("ddp", "fsdp2")}
    assert covered(pairwise(grown))
    assert FAST_ROW.keys() == AXES.keys() and all(FAST_ROW[a] in AXES[a] for a in AXES)


def test_the_fsdp2_design_covers_its_pairs_and_names_each_refusal():
    """FSDP2's rows: every pair of what it trains with (both checkpoint forms, 32-true and bf16-mixed, every
    objective, accumulation, unreadable micro-batch), one row per refusal, and DDP's row ids unchanged."""
    rows = fsdp2_design()
    trained = [r for r in rows if expected_refusal(r) is None]
    assert covered(trained, FSDP2_AXES) and len(trained) <= 32
    refused = [r for r in rows if expected_refusal(r) is not None]
    assert sorted(expected_refusal(r) for r in refused) == sorted(text for _, text in REFUSALS.values())
    assert all(r["strategy"] in ("fsdp2", "fsdp2_whole") for r in rows)
    assert len({row_id(r) for r in full_design()}) == len(design(AXES)) + len(rows)
    assert row_id(design(AXES)[0]) == "1-none-32-true-foreach-xcit_syncbn-dino-off"  # no strategy suffix
    assert expected_refusal({**FAST_ROW, "precision": "16-mixed"}) is None  # DDP trains in 16-mixed


def test_a_refusal_row_passes_only_on_its_one_line_error():
    row = next(r for r in fsdp2_design() if r["precision"] == "16-mixed")
    text = expected_refusal(row)
    ok = {"refused": f"UserError: {text} (a GradScaler's ...); use bf16-mixed"}
    result = checks.check_row(row, [ok, ok], ok, 4)
    assert {s for s, _ in result.values()} == {checks.REFUSED}
    trained = {"initial": {"state": {}}, "single": {}}
    assert checks.check_row(row, [ok, ok], trained, 4)["ranks equal"][0] == checks.FAIL
    other = {"refused": "UserError: compile is not supported under --trainer.strategy fsdp2"}
    assert checks.check_row(row, [ok, other], ok, 4)["ranks equal"][0] == checks.FAIL
    table = checks.table([row], [result], TABLE_AXES)
    assert table.splitlines()[-1].startswith("| 1 | none | 16-mixed |") and "| fsdp2 | refused |" in table


def _run(weights: dict[str, float], optimizer: list[float] | None = None) -> dict:
    state = {"student.w": torch.tensor(weights["s"]), "teacher.w": torch.tensor(weights["t"]),
             "dino_loss.center": torch.tensor([weights["c"]])}  # fmt: skip
    return {"state": state, "optimizer": [{"momentum_buffer": torch.tensor(optimizer or [1.0])}]}


def test_compare_fails_a_group_that_moved_apart_and_names_it():
    start = _run({"s": [0.0, 0.0], "t": [0.0, 0.0], "c": 0.0})["state"]
    ref = _run({"s": [1.0, 1.0], "t": [0.5, 0.5], "c": 1.0})
    near = _run({"s": [1.0, 1.0 + 1e-6], "t": [0.5, 0.5], "c": 1.0})
    assert checks.compare(near, ref, start, (1e-4, 1e-4))[0] == checks.PASS
    status, detail = checks.compare(
        _run({"s": [1.0, 1.0], "t": [0.5, 0.6], "c": 1.0}), ref, start, (1e-4, 1e-4)
    )
    assert status == checks.FAIL and detail.startswith("teacher")
    status, detail = checks.compare(
        _run({"s": [1, 1], "t": [0.5, 0.5], "c": 1}, [2.0]), ref, start, (1e-4, 1e-4)
    )
    assert status == checks.FAIL and detail.startswith("optimiser")


def test_host_reads_count_steady_windows_only():
    def window(batch_idx, found, marks=()):
        return {"batch_idx": batch_idx, "marks": list(marks), "found": [["read", s] for s in found]}

    run = {"census": [window(0, ["a"]), window(2, [], ["sync"]), window(3, [])]}
    assert checks.host_reads([run], 0)[0] == checks.PASS
    run["census"][1]["marks"] = []
    run["census"][1]["found"] = [["read", "x.py:1"]]
    assert checks.host_reads([run], 0) == (checks.FAIL, "1: x.py:1")


def test_expected_steps_per_unreadable_position():
    row = dict(FAST_ROW)
    assert checks.expected_steps({**row, "unreadable": "none"}, 4) == (4, 0)
    assert checks.expected_steps(row, 4) == (4, 1)  # a window keeps its other micro-batch
    assert checks.expected_steps({**row, "accumulate": "1"}, 4) == (3, 1)
    assert checks.expected_steps({**row, "unreadable": "every_rank", "accumulate": "3"}, 4) == (3, 3)


def test_a_student_that_never_moved_names_the_grad_scaler_skips():
    """The 16-mixed XCiT distill_dino row's FAIL detail named no cause: it must say that every step was a
    GradScaler skip, which the worker counts from the scale's halvings."""
    row = {**FAST_ROW, "unreadable": "every_rank", "accumulate": "3", "precision": "16-mixed"}
    start = {"student.w": torch.zeros(2)}
    run = {"losses": [1.0, None], "state": {"student.w": torch.zeros(2)}, "global_step": 3, "skipped": 3}
    scales = [torch.tensor(s) for s in (256.0, 128.0, 128.0, 64.0, 64.0, 32.0)]
    run["scaler_skips"] = matrix_worker.scaler_skips(scales)
    assert run["scaler_skips"] == 3
    assert matrix_worker.scaler_skips([torch.tensor(256.0), torch.tensor(256.0)]) == 0
    assert matrix_worker.scaler_skips([]) is None
    found = checks.finite_moved_steps(row, [run], start, 4)
    assert found == (
        checks.FAIL,
        "the student did not move: the GradScaler skipped 3 of 3 steps (inf/NaN gradients)",
    )
    run["state"] = {"student.w": torch.ones(2)}
    assert checks.finite_moved_steps(row, [run], start, 4) == (checks.PASS, "")


def test_a_teacher_moved_only_by_ema_rounding_does_not_pass_for_a_step():
    """3-one_rank-16-mixed-...-xcit_syncbn-dino passed "moved" with every step a GradScaler skip: the teacher's
    EMA of the unmoved student changed its last bits. The student must move too."""
    row = {**FAST_ROW, "precision": "16-mixed"}
    teacher = torch.rand(8, generator=torch.Generator().manual_seed(0))
    ema = 0.9 * teacher + (1 - 0.9) * teacher  # what the EMA does when the student never moved
    assert not torch.equal(ema, teacher)  # the rounding that made the check pass
    start = {"student.w": teacher.clone(), "teacher.w": teacher.clone()}
    run = {"losses": [1.0], "global_step": 4, "skipped": 1, "scaler_skips": 4,
           "state": {"student.w": teacher.clone(), "teacher.w": ema}}  # fmt: skip
    found = checks.finite_moved_steps(row, [run], start, 4)
    assert found == (
        checks.FAIL,
        "the student did not move: the GradScaler skipped 4 of 4 steps (inf/NaN gradients)",
    )
    run["state"]["student.w"] = teacher + 1
    assert checks.finite_moved_steps(row, [run], start, 4) == (checks.PASS, "")


def _assert_no_failure(rows: list[dict], results: list[dict]) -> None:
    table = checks.table(rows, results, TABLE_AXES)
    print("\n" + table)
    failed = [
        (row_id(r), c, d)
        for r, res in zip(rows, results, strict=True)
        for c, (s, d) in res.items()
        if s == checks.FAIL
    ]
    assert not failed, f"{len(failed)} failed cells:\n" + "\n".join(map(str, failed)) + "\n" + table


@pytest.mark.slow  # ~17 s; the default suite keeps test_a_seeded_defect_is_killed on the same row
@pytest.mark.distributed
def test_fast_row_holds_every_invariant(tmp_path):
    """One row: the 2-process runs under torchrun, the 1-process references in this process."""
    _assert_no_failure([FAST_ROW], run_matrix([FAST_ROW], tmp_path, in_process=True))


@pytest.mark.slow  # ~1.5 minutes a row on 2 shared cores
@pytest.mark.distributed
@pytest.mark.parametrize("row", OPTIM_ROWS, ids=row_id)
def test_optim_rows_hold_every_invariant(tmp_path, row):
    """The model's and the strategy's options outside the designs (``OPTIM_ROWS``) in company. DINOv3's
    optimisation (issue 53: ``optim: dinov3``): DDP with an unreadable micro-batch on one rank, bf16 on XCiT's
    synced BatchNorm with iBOT, and FSDP2, whose per-submodule clip must use the whole gradients' norm on every
    rank. Then ``init_from_ema``, ``koleo_group_size``, distillation's ``teacher_to_student_resolution_scale``
    and FSDP2's ``reshard_after_forward`` false (``-k ROW_ID`` runs one)."""
    # Rows of their own: the docs tables stay the designs' output.
    assert row not in full_design()
    _assert_no_failure([row], run_matrix([row], tmp_path))


@pytest.mark.slow  # DDP's rows: ~50 minutes on 2 shared cores; FSDP2's: ~15 minutes
@pytest.mark.distributed
@pytest.mark.parametrize("strategies", [("ddp",), ("fsdp2", "fsdp2_whole")], ids=["ddp", "fsdp2"])
def test_whole_matrix_holds_every_invariant(tmp_path, strategies):
    rows = full_design(strategies)
    _assert_no_failure(rows, run_matrix(rows, tmp_path))


_RESUME_COMPILED = """
import json, sys
from pathlib import Path
sys.path.insert(0, {here!r})
import torch
import matrix_checks, matrix_worker
torch.set_num_threads(1)
row = {row!r}
out = Path({out!r})
runs = matrix_worker.uninterrupted_and_resumed(row, out, 1, "cpu", matrix_worker.write_sources(out))
print(json.dumps(matrix_checks._identical(runs["resumed"], runs["full"])))
"""


@pytest.mark.slow
def test_a_compiled_xcit_row_resumes_equal_to_its_reference(tmp_path):
    """The matrix's resume reference for a compiled row is a compiled run: the census (a dispatch mode, under
    which dynamo runs compiled frames eagerly) once made it an eager one, and XCiT's ``aot_eager`` graphs differ
    from eager XCiT in the last bits, so two compiled XCiT rows failed their resume check. In a subprocess:
    ``torch.compile`` patched to ``aot_eager`` and dynamo's caches must not stay in the suite's process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    row = {
        **FAST_ROW,
        "accumulate": "1",
        "unreadable": "none",
        "optimizer": "foreach",
        "compile": "aot_eager",
    }
    here = str(Path(__file__).resolve().parent)
    code = _RESUME_COMPILED.format(here=here, row=row, out=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    status, detail = json.loads(done.stdout.strip().splitlines()[-1])
    assert status == checks.PASS, detail


# A one-file checkpoint under FSDP2 lost what only the module's own load_state_dict restores: a distillation
# run could not resume at all (Lightning asked for the frozen teacher the checkpoint leaves out), and a Gram run
# resumed with its Gram teacher marked not taken (the extra state), so it took a new one (159 tensors differed).
WHOLE_CHECKPOINT_ROWS = [
    {**FAST_ROW, "unreadable": "start", "optimizer": "foreach", "objective": "distill_dino",
     "strategy": "fsdp2_whole"},
    # Gram, and AdamW during DINO's last-layer freeze: the frozen layer has no optimiser state, and torch's
    # strict set_optimizer_state_dict refused the one-file checkpoint ("Missing optimizer state for parameter
    # 'student.head.last_layer.weight_v'"), found by the matrix's AdamW rows (issue 50).
    {**FAST_ROW, "unreadable": "every_rank", "precision": "bf16-mixed", "optimizer": "adamw", "objective": "gram",
     "strategy": "fsdp2_whole"},
    {**FAST_ROW, "accumulate": "3", "unreadable": "start", "precision": "bf16-mixed", "optimizer": "adamw",
     "norm": "vit_nobn", "strategy": "fsdp2_whole"},
]  # fmt: skip


@pytest.mark.slow  # ~2 minutes on 2 shared cores
@pytest.mark.distributed
def test_fsdp2_whole_checkpoints_resume_distillation_gram_and_a_frozen_layer(tmp_path):
    assert all(r in fsdp2_design() for r in WHOLE_CHECKPOINT_ROWS)
    _assert_no_failure(WHOLE_CHECKPOINT_ROWS, run_matrix(WHOLE_CHECKPOINT_ROWS, tmp_path))


def _section(page: str, name: str) -> list[str]:
    """The Markdown table lines between ``<!-- matrix:NAME -->`` and its end marker."""
    text = page.split(f"<!-- matrix:{name} -->", 1)[1].split(f"<!-- /matrix:{name} -->", 1)[0]
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.parametrize(
    "section, strategies", [("ddp", ("ddp",)), ("fsdp2+fsdp2_whole", ("fsdp2", "fsdp2_whole"))]
)
def test_the_docs_tables_are_the_codes_output(section, strategies):
    """docs/invariants.md's tables are written by ``matrix.py --docs``: their header is the checks the code runs
    now, their rows the design's rows, and no cell failed."""
    lines = _section(DOCS.read_text(), section)
    assert lines[:2] == checks.header(TABLE_AXES)
    rows = full_design(strategies)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[: len(TABLE_AXES)] for c in cells] == [[setting(r, a) for a in TABLE_AXES] for r in rows]
    assert not [c for c in cells if any(x.startswith(checks.FAIL) for x in c)]


def test_the_docs_mutant_table_kills_every_mutant_in_every_precision():
    lines = _section(DOCS.read_text(), "mutants")
    assert lines[0] == "| mutant | defect | " + " | ".join(PRECISIONS) + " |"
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[0] for c in cells] == [f"`{name}`" for name in MUTANTS]
    for row in cells:
        assert len(row) == 2 + len(PRECISIONS) and not any(c.startswith("SURVIVED") for c in row[2:]), row


@pytest.mark.distributed
def test_a_seeded_defect_is_killed(tmp_path):
    """The fast mutant: the window's cross-rank reduction sums instead of averaging (that window's gradient
    doubled). The weights hid it (the clip caps each gradient's norm); the window's gradients do not."""
    found = mutant_results(["reduce_divisor"], tmp_path, precisions=("32-true",))
    ((status, cell),) = found["reduce_divisor"]
    assert status == "killed" and cell.startswith("2 proc = 1 proc (gradients window 1"), cell


@pytest.mark.slow  # ~30 rows
@pytest.mark.distributed
def test_every_mutant_is_killed_in_every_precision(tmp_path):
    found = mutant_results(list(MUTANTS), tmp_path)
    survived = {name: cells for name, cells in found.items() if any(s == "SURVIVED" for s, _ in cells)}
    assert not survived, survived


def _sharded_run(student: torch.Tensor, center: torch.Tensor, rank: int) -> dict:
    """A rank's ``full`` run as ``matrix_worker`` records it under FSDP2: its shard of ``student`` (rows split as
    FSDP2 splits them), the replicated centre, no optimiser state, one window's gradient shard."""
    shard = checks.shard_of(student, rank, 2)
    local = {"state": {"student.w": (shard, True), "dino_loss.center": (center, False)}, "optimizer": [{}]}
    return {"full": {"local": local, "gradients": [{"w": (shard, True)}]}}


def test_fsdp2_ranks_equal_compares_each_ranks_own_shards_with_one_process():
    """The gathered whole state is the same all-gathered copy on both ranks by construction, so comparing it
    proved nothing (issue 50). Each rank's shard is compared with the same slice of the 1-process run, and the
    replicated tensors between the ranks."""
    start = {"student.w": torch.zeros(5, 2), "dino_loss.center": torch.zeros(3)}
    single_w, center = torch.arange(10.0).reshape(5, 2), torch.ones(3)
    single = {"state": {"student.w": single_w, "dino_loss.center": center}, "optimizer": [{}],
              "gradients": [{"w": (single_w, False)}]}  # fmt: skip
    tol = checks.tolerance({"optimizer": "foreach", "precision": "32-true"})
    two = [_sharded_run(single_w, center, r) for r in range(2)]
    assert checks.local_ranks_equal(two, single, start, tol, per_rank=False) == (checks.PASS, "")
    stale = single_w.clone()
    stale[3:] = 0  # rank 1's rows never moved (its EMA, say, did not run)
    two[1] = _sharded_run(stale, center, 1)
    status, detail = checks.local_ranks_equal(two, single, start, tol, per_rank=False)
    assert status == checks.FAIL and detail.startswith("rank 1's shards against 1 process"), detail
    two = [_sharded_run(single_w, center, 0), _sharded_run(single_w, center + 1e-7, 1)]
    status, detail = checks.local_ranks_equal(two, single, start, tol, per_rank=True)
    assert status == checks.FAIL and detail.startswith("replicated: 1 tensors"), detail


def test_window_gradients_catch_a_doubled_window_and_accept_a_shared_overflow():
    window = {"w": (torch.tensor([3.0, 4.0]), False)}
    doubled = {"w": (torch.tensor([6.0, 8.0]), False)}
    overflow = {"w": (torch.tensor([float("inf"), 1.0]), False)}
    assert checks.compare_gradients([window], [window], 1e-4)[0] == checks.PASS
    assert checks.compare_gradients([window, doubled], [window, window], 1e-1) == (
        checks.FAIL, "gradients window 1 1.0e+00",
    )  # fmt: skip
    assert checks.compare_gradients([overflow, window], [overflow, window], 1e-4)[0] == checks.PASS
    assert checks.compare_gradients([overflow], [window], 1e-4)[0] == checks.FAIL
    # Windows past GRADIENT_WINDOWS are left to the weights' check.
    late = [window] * checks.GRADIENT_WINDOWS + [doubled]
    assert checks.compare_gradients(late, [window] * len(late), 1e-4)[0] == checks.PASS


@pytest.mark.slow  # ~1 minute
@pytest.mark.distributed
def test_fsdp2_ranks_equal_catches_an_ema_on_one_rank(tmp_path):
    """Under FSDP2 the EMA updates each rank's own teacher shards: with rank 0's alone moving, rank 1's stay put.
    Gathered whole, both ranks held the same half-moved copy, and a comparison of the gathered copies passed."""
    from mutants import environment

    row = {**FAST_ROW, "accumulate": "1", "unreadable": "none", "optimizer": "foreach", "strategy": "fsdp2"}
    assert row in fsdp2_design()
    with environment("ema_one_rank"):
        (result,) = run_matrix([row], tmp_path)
    # Rank 1's teacher stays put, so the targets and every later gradient differ: the first group found may be
    # rank 0's optimiser state (measured 5.3e-1 of its movement) as well as rank 1's teacher.
    status, detail = result["ranks equal"]
    assert status == checks.FAIL and "'s shards against 1 process: " in detail, detail
