"""``ssl-xcit embed``: images -> one embedding row per image, in a file other tools read.

The rows are the frozen features of :mod:`ssl_xcit.evaluation.cached`, the path ``ssl-xcit knn`` takes: the same
eval transform, the same extraction (``Trainer.predict``, sharded over every GPU of a DDP run, each rank
holding the gathered result; global rank 0 alone writes) and the same feature cache. Unreadable images are
skipped; the rows keep dataset order and the skipped files are listed in the summary and in the file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.nn.functional as F

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.cache import checkpoint_fingerprint, precision_key
from ssl_xcit.evaluation.cached import dataset_features
from ssl_xcit.evaluation.checks import check_not_empty
from ssl_xcit.evaluation.embedding_files import embedding_format, output_files, write_embeddings
from ssl_xcit.evaluation.features import FeatureConfig
from ssl_xcit.models.sharded import is_checkpoint

__all__ = ["FEATURES", "feature_config", "embed_images"]

# --feature: what each row holds. "both" is ONE array, CLS first, the layout of `knn --avgpool-patchtokens`.
FEATURES = ("cls", "patch", "both")
# Skipped files named in the one-line summary; the output's metadata lists all of them.
_SUMMARY_SKIPPED = 10


def feature_config(feature: str, n_last_blocks: int = 1) -> FeatureConfig:
    """The :class:`FeatureConfig` of an ``embed --feature`` choice."""
    if feature not in FEATURES:
        raise UserError(f"unknown feature {feature!r}; valid features: {', '.join(FEATURES)}")
    if feature == "patch":
        if n_last_blocks != 1:
            raise UserError(
                f"--n-last-blocks {n_last_blocks} picks CLS embeddings, but --feature patch has none; "
                "use --feature both, or leave --n-last-blocks at 1"
            )
        return FeatureConfig(1, avgpool_patchtokens=True, cls_token=False)
    return FeatureConfig(n_last_blocks, avgpool_patchtokens=feature == "both")


def _is_rank_zero() -> bool:
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _check_output(output: str | os.PathLike, overwrite: bool) -> None:
    embedding_format(output)
    if overwrite:
        return
    for path in output_files(output):
        if path.exists():
            raise UserError(
                f"{path} exists; pass --overwrite to replace it (replaced only once the new file is complete)"
            )


def embed_images(
    data: str | os.PathLike,
    output: str | os.PathLike,
    *,
    weights: str | os.PathLike | None = None,
    arch: str | None = None,
    feature: str = "cls",
    n_last_blocks: int = 1,
    normalize: bool = False,
    overwrite: bool = False,
    batch_size: int = 128,
    num_workers: int = 8,
    resize_size: int = 256,
    crop_size: int = 224,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    accelerator: str = "auto",
    devices: int | str | list[int] = "auto",
    precision: str | None = None,
    seed: int = 0,
    progress: bool = True,
    print_summary: bool = True,
) -> dict[str, Any]:
    """Embed every readable image of ``data`` (a folder, an ImageFolder tree or a list file) into ``output``.

    Returns the summary (the output's ``meta`` plus ``skipped`` and ``files``). An existing output is an error
    unless ``overwrite``; either way it is replaced only by a complete new file.
    """
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.transforms import eval_transform

    _check_output(output, overwrite)
    config = feature_config(feature, n_last_blocks)
    if weights is not None and not is_checkpoint(weights):
        raise FileNotFoundError(f"weights file not found: {weights}")
    if weights is None and arch is None:
        raise UserError("give --weights, or --arch NAME to embed with a randomly initialised backbone")
    dataset = build_dataset(data, transform=eval_transform(resize=resize_size, crop=crop_size))
    check_not_empty(dataset, "embed", data)

    start = time.perf_counter()
    result, hit = dataset_features(
        dataset,
        "embed",
        weights=weights,
        arch=arch,
        config=config,
        cache_dir=cache_dir,
        use_cache=use_cache,
        seed=seed,
        batch_size=batch_size,
        num_workers=num_workers,
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        progress=progress,
    )
    features = result["features"].float()
    if normalize:
        features = F.normalize(features, dim=1)
    kept = result["indices"].tolist()
    kept_set = set(kept)
    paths = [str(dataset.samples[i][0]) for i in kept]
    skipped = [str(path) for i, (path, _) in enumerate(dataset.samples) if i not in kept_set]
    labelled = dataset.classes is not None
    meta = {
        "command": "ssl-xcit embed",
        "weights": str(weights) if weights is not None else None,
        "checkpoint_sha256": checkpoint_fingerprint(weights),
        "arch": arch or "inferred from checkpoint",
        "init": "pretrained" if weights is not None else f"random (seed {seed})",
        "feature": feature,
        "feature_key": config.name,
        "normalized": bool(normalize),
        "dim": int(features.shape[1]),
        "transform": repr(dataset.transform),
        "data": str(data),
        "num_images": len(dataset),
        "num_embedded": len(paths),
        "num_skipped": len(skipped),
        "precision": precision_key(precision),
        "feature_cache_hit": hit,
    }
    files: list[Path] = []
    if _is_rank_zero():
        files = write_embeddings(
            output,
            features,
            paths,
            labels=result["labels"] if labelled else None,
            classes=dataset.classes if labelled else None,
            skipped=skipped,
            meta=meta,
        )
    seconds = time.perf_counter() - start
    summary = {**meta, "skipped": skipped, "files": [str(f) for f in files], "seconds": round(seconds, 3)}
    if print_summary and _is_rank_zero():
        print(summary_line(summary, output))
    return summary


def summary_line(summary: dict[str, Any], output: str | os.PathLike) -> str:
    """One line: how many rows of what went where, and which files were skipped."""
    norm = ", L2-normalised" if summary["normalized"] else ""
    source = "feature cache" if summary["feature_cache_hit"] else "extracted"
    line = (
        f"embedded {summary['num_embedded']} of {summary['num_images']} images of {summary['data']} "
        f"({summary['dim']}-d {summary['feature']} feature{norm}, {source}) into {output} "
        f"in {summary['seconds']:.1f} s"
    )
    skipped = summary["skipped"]
    if not skipped:
        return line + "; none skipped"
    named = ", ".join(skipped[:_SUMMARY_SKIPPED])
    more = f" and {len(skipped) - _SUMMARY_SKIPPED} more" if len(skipped) > _SUMMARY_SKIPPED else ""
    return line + f"; skipped {len(skipped)} unreadable: {named}{more} (all listed in the file's 'skipped')"
