from __future__ import annotations

from ssl_xcit.evaluation.report import format_linear_table, sweep_edge


def _rows(best_lr: float) -> tuple[list[dict], dict]:
    rows = [
        {"base_lr": lr, "lr": lr, "top1": 50.0 + (lr == best_lr), "top5": 90.0} for lr in (1e-3, 1e-2, 1e-1)
    ]
    return rows, next(r for r in rows if r["base_lr"] == best_lr)


def test_best_lr_at_the_edge_of_the_sweep_is_said():
    rows, best = _rows(0.1)
    assert sweep_edge(rows, best) == "top"
    table = format_linear_table({"per_lr": rows, "best": best, "feature": "cls1", "epochs": 1})
    assert table.splitlines()[-1] == (
        "note: the best base_lr 0.1 is the top edge of the sweep; a higher one may be better (extend --lrs)"
    )
    assert sweep_edge(*_rows(1e-3)) == "bottom"
    rows, best = _rows(1e-2)
    assert sweep_edge(rows, best) is None and "note:" not in format_linear_table(
        {"per_lr": rows, "best": best}
    )
    assert sweep_edge(rows[:1], rows[0]) is None  # a single lr is not a sweep
