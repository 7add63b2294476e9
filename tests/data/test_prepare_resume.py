"""``prepare --resume``: a run killed partway (every process of it, as a scheduler does) and resumed stores every
record once, in order, exactly as an uninterrupted run; locally and on an S3-compatible server."""

from __future__ import annotations

from pathlib import Path

import pytest
from litdata import StreamingDataset

from ssl_xcit.cli.prepare import main as prepare_main
from ssl_xcit.data.shards import prepare_shards, read_meta
from ssl_xcit.errors import UserError

from .prepare_kill_worker import killed_prepare
from .test_shards import make_folder


def _records(root: str) -> list[tuple[str, bytes, int]]:
    ds = StreamingDataset(root)
    return [(r["path"], r["image"], r["label"]) for r in (ds[i] for i in range(len(ds)))]


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_killed_prepare_resumes_without_repeating_or_losing_a_record(where, tmp_path, request):
    src = make_folder(tmp_path / "src", {"a": [(40, 30)] * 10, "b": [(30, 50)] * 10})
    (src / "a" / "img03.jpg").write_bytes(b"not an image")  # an input that stores no record, before the kill
    out = request.getfixturevalue("s3_env") + "/out" if where == "s3" else str(tmp_path / "out")
    # Worker 0 takes listing indices 0-9, worker 1 10-19: killed at index 8, after several stored chunks.
    assert killed_prepare(8, str(src), out, workers=2, chunk_bytes="3KB", progress=False) == -9
    with pytest.raises(UserError, match="holds an interrupted `ssl-xcit prepare`.*pass --resume"):
        prepare_shards(src, out, workers=2, chunk_bytes="3KB", progress=False)
    with pytest.raises(UserError, match="the interrupted prepare had other chunk_bytes"):
        prepare_shards(src, out, workers=2, chunk_bytes="4KB", resume=True, progress=False)
    resumed = prepare_shards(src, out, workers=2, chunk_bytes="3KB", resume=True, progress=False)

    # What an uninterrupted run stores: every readable file once, in listing order, its bytes and class index.
    files = [p for p in sorted(src.rglob("*.jpg")) if p.name != "img03.jpg" or p.parent.name != "a"]
    expected = [(p.relative_to(src).as_posix(), p.read_bytes(), "ab".index(p.parent.name)) for p in files]
    assert _records(out) == expected and len(expected) == 19
    assert (resumed["records"], resumed["skipped"]) == (19, ["a/img03.jpg"])
    assert read_meta(out)["id"] == resumed["id"]
    if where == "local":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no partial folder left
        assert not (Path(out) / ".checkpoints").exists()
    # finished: left as it is, so a requeued job can run the same command line
    again = prepare_main(
        [str(src), out, "--workers", "2", "--chunk-bytes", "3KB", "--resume", "--no-progress"]
    )
    assert again == resumed
