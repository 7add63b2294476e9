"""Ground-truth parsers of INRIA Holidays, UKBench and the generic JSON benchmark format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ssl_xcit.errors import UserError
from ssl_xcit.retrieval.ground_truth import (
    _MAX_LISTED,
    RetrievalDataset,
    _gt_error,
    _index_list,
    check_files_exist,
)


def _benchmark_files(root: Path, what: str) -> list:
    """The image files of a benchmark folder, or the records of a prepared dataset of it (``ssl-xcit prepare``;
    record names are the files' names, so the same ground truth follows from them), sorted by name."""
    from ssl_xcit.data.shards import is_shard_root

    if is_shard_root(root):
        from ssl_xcit.data.shard_dataset import ShardImageDataset
        from ssl_xcit.retrieval.images import RecordRef

        dataset = ShardImageDataset(root, labelled=False)
        items = [RecordRef(dataset, i) for i in range(len(dataset))]
    else:
        items = list(_image_folder(root, what).iterdir())
    return sorted(items, key=lambda p: p.name)


def _image_folder(root: Path, what: str) -> Path:
    if not root.is_dir():
        raise FileNotFoundError(f"{what} image folder not found: {root}")
    # The official tarballs unpack into jpg/ (Holidays) or full/ (UKBench); accept the folder itself too.
    for sub in ("jpg", "full"):
        if (root / sub).is_dir():
            return root / sub
    return root


def load_rotations(path: str | Path) -> dict[str, int]:
    """A rotation list: one ``name angle`` per line (name with or without extension; angle in 0/90/180/270,
    counter-clockwise as in ``PIL.Image.rotate``), e.g. the upright-corrected "rotated Holidays" variant."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rotation list not found: {path}")
    out = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"-?\d+", parts[1]) or int(parts[1]) % 90:
            raise UserError(
                f"{path}:{lineno}: expected 'name angle' with angle a multiple of 90, got {line!r}"
            )
        out[Path(parts[0]).stem] = int(parts[1]) % 360
    return out


def load_holidays(root: str | Path, rotations: str | Path | None = None) -> RetrievalDataset:
    """INRIA Holidays: ``NNNNNN.jpg`` files, group = NNNNNN // 100, the query has NNNNNN % 100 == 0.

    The database holds every image (queries included); each query is removed from its own ranking and its
    positives are the other images of its group (Jegou et al.'s ``holidays_map.py``). EXIF orientation is
    honoured; ``rotations`` (see :func:`load_rotations`) gives the upright "rotated Holidays" variant.
    """
    folder = Path(root)
    files = [p for p in _benchmark_files(folder, "Holidays") if p.suffix.lower() in (".jpg", ".jpeg")]
    bad = [p.name for p in files if not p.stem.isdigit()]
    if bad:
        raise UserError(f"Holidays file names must be image numbers like 100000.jpg; got {bad[:_MAX_LISTED]}")
    if not files:
        raise FileNotFoundError(f"no Holidays images (NNNNNN.jpg) in {folder}")
    numbers = np.array([int(p.stem) for p in files])
    groups = numbers // 100
    is_query = numbers % 100 == 0
    no_query = sorted(set(groups.tolist()) - set(groups[is_query].tolist()))
    if no_query:
        raise UserError(
            f"Holidays groups {no_query[:_MAX_LISTED]} have no query image (the one numbered group*100); "
            "the folder is incomplete"
        )
    queries, gnd, qidx = [], [], []
    for i in np.flatnonzero(is_query):
        members = np.flatnonzero(groups == groups[i])
        queries.append(files[i])
        qidx.append(int(i))
        gnd.append({"ok": members[members != i].astype(np.int64), "junk": np.zeros(0, dtype=np.int64)})
    rot = load_rotations(rotations) if rotations else {}
    unknown = sorted(set(rot) - {p.stem for p in files})
    if unknown:
        raise UserError(f"rotation list names images not in {folder}: {unknown[:_MAX_LISTED]}")
    return RetrievalDataset(
        "holidays",
        "holidays",
        list(files),
        queries,
        gnd,
        query_db_index=qidx,
        rotations=rot,
        groups=groups.tolist(),
    )


def load_ukbench(root: str | Path) -> RetrievalDataset:
    """UKBench: ``ukbenchNNNNN.jpg``, groups of 4 consecutive numbers; every image queries all images."""
    folder = Path(root)
    files = [
        p for p in _benchmark_files(folder, "UKBench") if re.fullmatch(r"ukbench\d+\.jpg", p.name, flags=re.I)
    ]
    if not files:
        raise FileNotFoundError(f"no UKBench images (ukbenchNNNNN.jpg) in {folder}")
    groups = np.array([int(p.stem[7:]) // 4 for p in files])
    gnd = []
    for i in range(len(files)):
        members = np.flatnonzero(groups == groups[i])
        gnd.append({"ok": members[members != i].astype(np.int64), "junk": np.zeros(0, dtype=np.int64)})
    return RetrievalDataset(
        "ukbench",
        "ukbench",
        list(files),
        list(files),
        gnd,
        query_db_index=list(range(len(files))),
        groups=groups.tolist(),
    )


def load_json_benchmark(path: str | Path) -> RetrievalDataset:
    """A user benchmark described by one JSON file::

        {"root": "images",                      # optional; relative paths resolve against it (itself
                                                 #   relative to the JSON file's folder)
         "database": ["a.jpg", "b.jpg", ...],
         "queries": ["q1.jpg", {"path": "q2.jpg", "bbx": [x1, y1, x2, y2]}, ...],
         "positives": [[0, 3], ["b.jpg"], ...],  # per query: database indices or database paths
         "junk": [[], [5], ...]}                 # optional, same form

    A query whose path is also in the database is removed from its own ranking (Holidays style), so it must not
    list itself among its positives; an image is never both a positive and junk of one query. A query
    ``bbx`` is in pixels of the original image after its EXIF orientation is applied.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark JSON not found: {path}")
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise _gt_error(path, f"invalid JSON ({err})") from err
    if not isinstance(spec, dict):
        raise _gt_error(
            path, f"expected an object with database, queries, positives; got {type(spec).__name__}"
        )
    missing = [k for k in ("database", "queries", "positives") if k not in spec]
    if missing:
        raise _gt_error(path, f"missing keys {missing} (has {sorted(spec)})")
    base = path.parent / spec.get("root", ".")

    def resolve(p) -> Path:
        p = Path(p)
        return p if p.is_absolute() else base / p

    database = [resolve(p) for p in spec["database"]]
    if not database:
        raise _gt_error(path, "the database is empty")
    if not spec["queries"]:
        raise _gt_error(path, "the query list is empty")
    db_index = {str(p): i for i, p in enumerate(database)}
    queries, bbx = [], []
    for i, q in enumerate(spec["queries"]):
        if isinstance(q, dict):
            if "path" not in q:
                raise _gt_error(path, f"queries[{i}] is an object without 'path'")
            box = q.get("bbx")
            if box is not None and (len(box) != 4 or not (box[2] > box[0] and box[3] > box[1])):
                raise _gt_error(
                    path, f"queries[{i}].bbx must be [x1, y1, x2, y2] with x2 > x1, y2 > y1; got {box}"
                )
            queries.append(resolve(q["path"]))
            bbx.append(None if box is None else tuple(float(v) for v in box))
        else:
            queries.append(resolve(q))
            bbx.append(None)
    positives, junk = spec["positives"], spec.get("junk") or [[] for _ in queries]
    for key, lists in (("positives", positives), ("junk", junk)):
        if not isinstance(lists, list) or len(lists) != len(queries):
            n = len(lists) if isinstance(lists, list) else type(lists).__name__
            raise _gt_error(path, f"{key!r} must be a list with one list per query ({len(queries)}), got {n}")

    def indices(items, where):
        if not isinstance(items, list):
            raise _gt_error(path, f"{where} must be a list, got {type(items).__name__}")
        out = []
        for item in items:
            if isinstance(item, str):
                key = str(resolve(item))
                if key not in db_index:
                    raise _gt_error(path, f"{where} names {item!r}, which is not in the database")
                out.append(db_index[key])
            else:
                out.append(item)
        return _index_list(out, path, where, len(database))

    gnd = [
        {"ok": indices(positives[i], f"positives[{i}]"), "junk": indices(junk[i], f"junk[{i}]")}
        for i in range(len(queries))
    ]
    qidx = [db_index.get(str(q)) for q in queries]
    for i, (g, q) in enumerate(zip(gnd, qidx, strict=True)):
        both = np.intersect1d(g["ok"], g["junk"])
        if both.size:
            raise _gt_error(
                path,
                f"positives[{i}] and junk[{i}] share database indices {both.tolist()}; each is one or the other",
            )
        if q is not None and q in g["ok"]:
            raise _gt_error(
                path,
                f"positives[{i}] lists query {i} itself (database index {q}); a query that is in the database is "
                "removed from its own ranking, so list only the other images of its group",
            )
    check_files_exist(list(dict.fromkeys(database + queries)), "benchmark image")
    return RetrievalDataset(path.stem, "generic", database, queries, gnd, query_bbx=bbx, query_db_index=qidx)
