"""`ssl-xcit fit -c recipes/quickstart.yaml` in the half precisions, through the console entry point: the
"true" ones are refused in one line that names bf16-mixed (``ssl_xcit.dino.precision``), the mixed one trains
with the k-NN monitor on."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssl_xcit.cli import console_main

from .conftest import TINY_ARGS

REPO = Path(__file__).resolve().parents[2]


def quickstart(tmp_path: Path, image_folder: Path, precision: str) -> list[str]:
    """The quickstart recipe, shrunk as the CLI tests shrink it (1 block, 16 px, 4 steps), k-NN monitor on."""
    return [
        "fit", "-c", str(REPO / "recipes" / "quickstart.yaml"), *(a for a in TINY_ARGS if "progress_bar" not in a),
        f"--data.init_args.root={image_folder / 'train'}", f"--data.init_args.val_root={image_folder / 'val'}",
        f"--trainer.precision={precision}", f"--run_dir={tmp_path / 'run'}",
    ]  # fmt: skip


@pytest.mark.parametrize("precision,mixed", [("bf16-true", "bf16-mixed"), ("16-true", "16-mixed")])
def test_quickstart_refuses_true_half_precision_in_one_line(tmp_path, image_folder, capsys, precision, mixed):
    with pytest.raises(SystemExit) as exit_info:
        console_main(quickstart(tmp_path, image_folder, precision))
    # Lightning's INFO lines come first; the report is the end of stderr: the message and the traceback hint.
    err = capsys.readouterr().err
    report = err[err.index("ssl-xcit fit: error:") :].strip().splitlines()
    assert exit_info.value.code == 2 and len(report) == 2 and "Traceback" not in err.split("INFO:")[-1]
    assert f"precision '{precision}'" in report[0] and f"use --trainer.precision {mixed}" in report[0]


def test_quickstart_trains_in_bf16_mixed_with_the_knn_monitor(tmp_path, image_folder):
    cli = console_main(quickstart(tmp_path, image_folder, "bf16-mixed")) or None
    assert cli is None  # the console entry returns nothing; the run's results are in its folder
    metrics = (tmp_path / "run" / "csv" / "version_0" / "metrics.csv").read_text()
    assert "knn/top1" in metrics.splitlines()[0]
