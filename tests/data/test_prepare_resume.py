"""``prepare --resume``: a run killed partway (every process of it, as a scheduler does) and resumed stores every
record once, in order, exactly as an uninterrupted run; locally and on an S3-compatible server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from litdata import StreamingDataset

from ssl_xcit.data.shards import prepare_shards, read_meta
from ssl_xcit.errors import UserError

from .test_shards import make_folder

KILLER = Path(__file__).with_name("prepare_kill_worker.py")


def _records(root: str) -> list[tuple[str, bytes, int]]:
    ds = StreamingDataset(root)
    return [(r["path"], r["image"], r["label"]) for r in (ds[i] for i in range(len(ds)))]


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_killed_prepare_resumes_without_repeating_or_losing_a_record(where, tmp_path, request):
    src = make_folder(tmp_path / "src", {"a": [(40, 30)] * 10, "b": [(30, 50)] * 10})
    (src / "a" / "img03.jpg").write_bytes(b"not an image")  # an input that stores no record, before the kill
    out = request.getfixturevalue("s3_env") + "/out" if where == "s3" else str(tmp_path / "out")
    args = [str(src), out, "--workers", "2", "--chunk-bytes", "3KB", "--no-progress"]
    # Worker 0 takes listing indices 0-9, worker 1 10-19: killed at index 8, after several stored chunks.
    killed = subprocess.run(
        [sys.executable, str(KILLER), "8", "prepare", *args], start_new_session=True, capture_output=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    with pytest.raises(UserError, match="holds an interrupted `ssl-xcit prepare`.*pass --resume"):
        prepare_shards(src, out, workers=2, chunk_bytes="3KB", progress=False)
    with pytest.raises(UserError, match="the interrupted prepare had other chunk_bytes"):
        prepare_shards(src, out, workers=2, chunk_bytes="4KB", resume=True, progress=False)
    resumed = prepare_shards(src, out, workers=2, chunk_bytes="3KB", resume=True, progress=False)

    clean = prepare_shards(src, tmp_path / "clean", workers=2, chunk_bytes="3KB", progress=False)
    assert _records(out) == _records(str(tmp_path / "clean"))
    assert len(_records(out)) == 19
    assert {k: v for k, v in resumed.items() if k != "id"} == {k: v for k, v in clean.items() if k != "id"}
    assert resumed["skipped"] == ["a/img03.jpg"] and read_meta(out)["id"] == resumed["id"]
    if where == "local":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["clean", "out", "src"]  # no partial folder left
        assert not (Path(out) / ".checkpoints").exists()
    again = prepare_shards(src, out, workers=2, resume=True, progress=False)  # finished: left as it is
    assert again == resumed
