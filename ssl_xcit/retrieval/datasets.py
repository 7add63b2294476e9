"""Retrieval benchmarks (Revisited Oxford/Paris, INRIA Holidays, UKBench, a generic JSON format) and their loader.

Image scaling convention (one rule for every benchmark, documented in the README):

* An image is resized so that its longer side is ``resolution`` pixels (up or down), keeping the aspect ratio;
  each side is then rounded to the NEAREST multiple of the patch size (at least one patch). The aspect ratio is
  distorted by at most half a patch per side (< 1.1% at 768 px with 16-px patches).
* A query cropped to its bounding box keeps the scale it has in the full image resized to ``resolution``
  (cirtorch's convention, used by HOW and most CNN retrieval papers): the crop is resized by
  ``resolution / max(full width, full height)``, then rounded to patch multiples the same way.
* JPEGs are decoded with PIL's ``draft`` at the smallest DCT scale that still covers the target size, which
  makes 3264x2448 Holidays photos about 8x cheaper to decode at 768 px and does not change what the network sees
  beyond the resampling filter.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DATASETS = ("roxford5k", "rparis6k", "holidays", "ukbench", "json")
_MAX_LISTED = 10


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

    def describe(self) -> dict[str, object]:
        """What identifies this benchmark's inputs (for cache keys)."""
        return {
            "name": self.name,
            "database": [str(p) for p in self.database],
            "queries": [str(p) for p in self.queries],
            "bbx": self.query_bbx,
            "exif_transpose": self.exif_transpose,
            "rotations": sorted(self.rotations.items()),
        }


# --------------------------------------------------------------------------------------------------------------
# Errors shared by the loaders
# --------------------------------------------------------------------------------------------------------------


def check_files_exist(paths: Sequence[Path], what: str) -> None:
    """Raise one FileNotFoundError listing the first missing files and how many are missing in all."""
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        shown = "\n  ".join(missing[:_MAX_LISTED])
        more = f"\n  ... and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise FileNotFoundError(f"{len(missing)} of {len(paths)} {what} files are missing:\n  {shown}{more}")


def _gt_error(source: Path | str, message: str) -> ValueError:
    return ValueError(f"malformed ground truth in {source}: {message}")


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


# --------------------------------------------------------------------------------------------------------------
# Revisited Oxford / Paris
# --------------------------------------------------------------------------------------------------------------


def load_revisited_gnd(path: str | Path) -> dict:
    """Read and validate a revisitop ``gnd_r*.pkl`` (keys imlist, qimlist, gnd[bbx, easy, hard, junk])."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"ground-truth file not found: {path} (expected revisitop's gnd_<dataset>.pkl)"
        )
    try:
        with open(path, "rb") as handle:
            cfg = pickle.load(handle)
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


# --------------------------------------------------------------------------------------------------------------
# INRIA Holidays and UKBench
# --------------------------------------------------------------------------------------------------------------


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
            raise ValueError(
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
    folder = _image_folder(Path(root), "Holidays")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    bad = [p.name for p in files if not p.stem.isdigit()]
    if bad:
        raise ValueError(
            f"Holidays file names must be image numbers like 100000.jpg; got {bad[:_MAX_LISTED]}"
        )
    if not files:
        raise FileNotFoundError(f"no Holidays images (NNNNNN.jpg) in {folder}")
    numbers = np.array([int(p.stem) for p in files])
    groups = numbers // 100
    is_query = numbers % 100 == 0
    no_query = sorted(set(groups.tolist()) - set(groups[is_query].tolist()))
    if no_query:
        raise ValueError(
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
        raise ValueError(f"rotation list names images not in {folder}: {unknown[:_MAX_LISTED]}")
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
    folder = _image_folder(Path(root), "UKBench")
    files = sorted(p for p in folder.iterdir() if re.fullmatch(r"ukbench\d+\.jpg", p.name, flags=re.I))
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


# --------------------------------------------------------------------------------------------------------------
# Generic JSON benchmark
# --------------------------------------------------------------------------------------------------------------


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


def load_dataset(
    name: str,
    root: str | Path,
    crop_queries: bool = True,
    gnd_path: str | Path | None = None,
    rotations: str | Path | None = None,
) -> RetrievalDataset:
    """Dispatch on the benchmark name (``roxford5k``, ``rparis6k``, ``holidays``, ``ukbench`` or ``json``)."""
    if name in ("roxford5k", "rparis6k"):
        return load_revisited(name, root, gnd_path=gnd_path, crop_queries=crop_queries)
    if name == "holidays":
        return load_holidays(root, rotations=rotations)
    if name == "ukbench":
        return load_ukbench(root)
    if name == "json":
        return load_json_benchmark(root)
    raise ValueError(f"unknown retrieval dataset {name!r}; valid: {', '.join(DATASETS)}")


def list_images(source: str | Path) -> list[Path]:
    """Images of a training set: a folder searched recursively, or a .txt file with one path per line."""
    source = Path(source)
    if source.is_file():
        lines = [
            ln.split()[0] for ln in source.read_text().splitlines() if ln.strip() and not ln.startswith("#")
        ]
        paths = [p if p.is_absolute() else source.parent / p for p in map(Path, lines)]
        check_files_exist(paths, f"training-set image (listed in {source})")
    elif source.is_dir():
        paths = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
    else:
        raise FileNotFoundError(
            f"training image set not found: {source} (give a folder or a .txt list of paths)"
        )
    if not paths:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in {source}")
    return paths


# --------------------------------------------------------------------------------------------------------------
# Image loading
# --------------------------------------------------------------------------------------------------------------


def target_size(width: float, height: float, scale: float, patch_size: int) -> tuple[int, int]:
    """``(width, height)`` scaled by ``scale``, each side rounded to the nearest patch multiple (>= 1 patch)."""

    def side(v: float) -> int:
        return max(patch_size, int(math.floor(v * scale / patch_size + 0.5)) * patch_size)

    return side(width), side(height)


def load_image(
    path: str | Path,
    resolution: int,
    patch_size: int,
    bbx: tuple[float, float, float, float] | None = None,
    exif_transpose: bool = True,
    rotation: int = 0,
) -> Image.Image:
    """Decode, orient, optionally crop, and resize an image following the module's scaling convention."""
    path = Path(path)
    try:
        with Image.open(path) as im:
            stored_w, stored_h = im.size
            scale = resolution / max(stored_w, stored_h)
            if im.format == "JPEG" and scale < 1:
                # draft keeps both sides >= the request, so ask for the aspect-preserving target size.
                im.draft("RGB", (math.ceil(stored_w * scale), math.ceil(stored_h * scale)))
            im.load()
            if exif_transpose:
                im = ImageOps.exif_transpose(im)
            im = im.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from err
    # decoded = (decoded pixels) / (original pixels): draft scales both axes alike, and max() is unchanged by an
    # EXIF 90-degree turn.
    decoded = max(im.size) / max(stored_w, stored_h)
    if rotation:
        im = im.rotate(rotation, expand=True)
    full_w, full_h = im.width / decoded, im.height / decoded  # in original pixels
    if bbx is not None:
        x1, y1, x2, y2 = (v * decoded for v in bbx)
        box = (
            max(0, round(x1)),
            max(0, round(y1)),
            min(im.width, max(round(x2), round(x1) + 1)),
            min(im.height, max(round(y2), round(y1) + 1)),
        )
        if box[0] >= box[2] or box[1] >= box[3]:
            raise ValueError(f"bounding box {bbx} lies outside image {path} ({full_w:.0f}x{full_h:.0f})")
        im = im.crop(box)
        crop_w, crop_h = (box[2] - box[0]) / decoded, (box[3] - box[1]) / decoded
    else:
        crop_w, crop_h = full_w, full_h
    size = target_size(crop_w, crop_h, resolution / max(full_w, full_h), patch_size)
    return im.resize(size, Image.Resampling.BICUBIC)


def to_tensor(im: Image.Image) -> torch.Tensor:
    """(3, H, W) float tensor normalised with the ImageNet mean and std the backbones were trained with."""
    x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (x - mean) / std


class ImageList(torch.utils.data.Dataset):
    """Images resized for retrieval; ``__getitem__`` returns ``(tensor (3, H, W), index)``."""

    def __init__(
        self,
        paths: Sequence[Path],
        resolution: int,
        patch_size: int,
        bbx: Sequence[tuple[float, float, float, float] | None] | None = None,
        exif_transpose: bool = True,
        rotations: dict[str, int] | None = None,
    ) -> None:
        self.paths = list(paths)
        self.bbx = list(bbx) if bbx is not None else [None] * len(self.paths)
        self.resolution, self.patch_size = resolution, patch_size
        self.exif_transpose = exif_transpose
        self.rotations = rotations or {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        p = Path(self.paths[i])
        im = load_image(
            p,
            self.resolution,
            self.patch_size,
            self.bbx[i],
            self.exif_transpose,
            self.rotations.get(p.stem, 0),
        )
        return to_tensor(im), i
