"""Retrieval ground truth: the benchmark record every loader returns, and the revisited Oxford/Paris parser.

The other formats (Holidays, UKBench, a generic JSON file) are in :mod:`.benchmarks`; image loading is in
:mod:`.images`.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ssl_xcit.errors import UserError

_MAX_LISTED = 10


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles plain Python data only: revisitop's ``gnd_*.pkl`` files hold dicts, lists, strings, ints and
    floats, and name no global at all. ``pickle.load`` would import and call whatever a file names (code
    execution from a downloaded file); here any global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


@dataclass
class RetrievalDataset:
    """A query set ranked against a database, with the ground truth its ``protocol`` needs.

    ``protocol`` is ``"revisited"`` (``gnd`` entries hold ``easy``/``hard``/``junk`` database indices),
    ``"holidays"`` or ``"generic"`` (``gnd`` entries hold ``ok``/``junk``), or ``"ukbench"`` (``groups``).
    ``query_db_index[i]`` is the database index of query i when the query is itself in the database; it is
    removed from its own ranking (Holidays protocol).
    """

    name: str
    protocol: str
    database: list[Path]
    queries: list[Path]
    gnd: list[dict[str, np.ndarray]]
    query_bbx: list[tuple[float, float, float, float] | None] = field(default_factory=list)
    query_db_index: list[int | None] = field(default_factory=list)
    groups: list[int] | None = None
    exif_transpose: bool = True
    rotations: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.query_bbx:
            self.query_bbx = [None] * len(self.queries)
        if not self.query_db_index:
            self.query_db_index = [None] * len(self.queries)


def check_files_exist(paths: Sequence[Path], what: str) -> None:
    """Raise one FileNotFoundError listing the first missing files and how many are missing in all."""
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        shown = "\n  ".join(missing[:_MAX_LISTED])
        more = f"\n  ... and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise FileNotFoundError(f"{len(missing)} of {len(paths)} {what} files are missing:\n  {shown}{more}")


def _gt_error(source: Path | str, message: str) -> UserError:
    return UserError(f"malformed ground truth in {source}: {message}")


def _index_list(value, source, where: str, n_db: int) -> np.ndarray:
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise _gt_error(source, f"{where} must be a list of database indices, got {type(value).__name__}")
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1:
        raise _gt_error(
            source, f"{where} must be a flat list of integers, got {np.asarray(value).tolist()[:5]}..."
        )
    bad = arr[(arr < 0) | (arr >= n_db)]
    if bad.size:
        raise _gt_error(
            source, f"{where} has indices {bad[:5].tolist()} outside the database range [0, {n_db})"
        )
    return arr.astype(np.int64)


def load_revisited_gnd(path: str | Path) -> dict:
    """Read and validate a revisitop ``gnd_r*.pkl`` (keys imlist, qimlist, gnd[bbx, easy, hard, junk])."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"ground-truth file not found: {path} (expected revisitop's gnd_<dataset>.pkl)"
        )
    try:
        with open(path, "rb") as handle:
            cfg = _PlainDataUnpickler(handle).load()
    except pickle.UnpicklingError as err:
        if str(err).startswith("refused global"):
            raise _gt_error(
                path, f"{err}: a ground-truth pickle holds only lists, dicts, strings and numbers"
            ) from None
        raise _gt_error(path, f"not a readable pickle ({type(err).__name__}: {err})") from err
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the file is not a gnd file
        raise _gt_error(path, f"not a readable pickle ({type(err).__name__}: {err})") from err
    if not isinstance(cfg, dict):
        raise _gt_error(path, f"expected a dict with keys imlist, qimlist, gnd; got {type(cfg).__name__}")
    missing = [k for k in ("imlist", "qimlist", "gnd") if k not in cfg]
    if missing:
        raise _gt_error(path, f"missing keys {missing} (has {sorted(cfg)})")
    imlist, qimlist, gnd = cfg["imlist"], cfg["qimlist"], cfg["gnd"]
    if len(gnd) != len(qimlist):
        raise _gt_error(path, f"gnd has {len(gnd)} entries but qimlist has {len(qimlist)} queries")
    n_db = len(imlist)
    clean = []
    for i, g in enumerate(gnd):
        if not isinstance(g, dict):
            raise _gt_error(path, f"gnd[{i}] must be a dict, got {type(g).__name__}")
        absent = [k for k in ("bbx", "easy", "hard", "junk") if k not in g]
        if absent:
            raise _gt_error(path, f"gnd[{i}] (query {qimlist[i]!r}) lacks keys {absent}")
        bbx = g["bbx"]
        if bbx is not None and (len(bbx) != 4 or not (bbx[2] > bbx[0] and bbx[3] > bbx[1])):
            raise _gt_error(
                path, f"gnd[{i}]['bbx'] must be [x1, y1, x2, y2] with x2 > x1, y2 > y1; got {bbx}"
            )
        clean.append(
            {
                "bbx": None if bbx is None else tuple(float(v) for v in bbx),
                **{k: _index_list(g[k], path, f"gnd[{i}][{k!r}]", n_db) for k in ("easy", "hard", "junk")},
            }
        )
    return {"imlist": list(imlist), "qimlist": list(qimlist), "gnd": clean}


def load_revisited(
    name: str, root: str | Path, gnd_path: str | Path | None = None, crop_queries: bool = True
) -> RetrievalDataset:
    """ROxford5k / RParis6k: ``<root>/jpg/<name>.jpg`` and ``<root>/gnd_<name>.pkl`` (revisitop layout).

    Queries are cropped to their bounding box by default, as the revisited protocol requires. EXIF orientation
    is NOT applied: the boxes are in stored-pixel coordinates, as revisitop reads them.
    """
    root = Path(root)
    cfg = load_revisited_gnd(gnd_path or root / f"gnd_{name}.pkl")
    jpg = root / "jpg"
    database = [jpg / f"{n}.jpg" for n in cfg["imlist"]]
    queries = [jpg / f"{n}.jpg" for n in cfg["qimlist"]]
    check_files_exist(database + queries, f"{name} image")
    gnd = [{k: g[k] for k in ("easy", "hard", "junk")} for g in cfg["gnd"]]
    bbx = [g["bbx"] if crop_queries else None for g in cfg["gnd"]]
    return RetrievalDataset(name, "revisited", database, queries, gnd, query_bbx=bbx, exif_transpose=False)
