"""``ssl-xcit retrieval``: image-retrieval benchmark of a frozen backbone (XCiT appendix D.3, Table D.4).

    ssl-xcit retrieval --weights W --dataset roxford5k --data-root D --method vlad --train-images T
    ssl-xcit retrieval --config eval/retrieval.yaml --weights W --data-root D   # flags override the file

Prints a table shaped like Table D.4 and returns (and with --output writes) the results dict.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import yaml

from ssl_xcit.errors import UserError
from ssl_xcit.retrieval.datasets import DATASETS
from ssl_xcit.retrieval.pipeline import METHODS, RetrievalConfig, run_retrieval


def _optional_int(value: str) -> int | None:
    return None if value.lower() in ("none", "all", "0") else int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ssl-xcit retrieval",
        description="Rank a retrieval benchmark with CLS, VLAD or ASMK descriptors of a frozen XCiT.",
    )
    p.add_argument("--config", help="YAML file whose keys are these options (underscored); flags override it")
    p.add_argument(
        "--weights", help="checkpoint (ours, timm, official XCiT/DINO); 'none' = random init (baseline)"
    )
    p.add_argument(
        "--arch", help="model name (e.g. xcit_small_12_p16); inferred from the checkpoint if omitted"
    )
    p.add_argument(
        "--dataset", choices=DATASETS, help="benchmark; 'json' reads --data-root as a benchmark JSON"
    )
    p.add_argument("--data-root", help="benchmark folder (<root>/jpg + gnd_<dataset>.pkl for R-Oxford/Paris)")
    p.add_argument("--method", choices=METHODS, help="cls (default), vlad or asmk")
    p.add_argument("--resolution", type=int, help="longer image side in px (default 768, the paper's pivot)")
    p.add_argument(
        "--codebook-size",
        type=int,
        help="k; default 256 for VLAD (paper: 256/1024) and 1024 for ASMK (paper: 1024/65536)",
    )
    p.add_argument(
        "--train-images",
        help="folder, .txt list or prepared dataset (ssl-xcit prepare) of images to learn PCA/codebooks on, "
        "independent of the benchmark; "
        "'database' learns on the benchmark's own database (optimistic)",
    )
    p.add_argument("--max-train-images", type=_optional_int, help="use at most this many training images")
    p.add_argument(
        "--max-local",
        type=_optional_int,
        help="keep the N patch tokens of largest norm per image (default 1000, as HOW; 'all' keeps every token)",
    )
    p.add_argument(
        "--local-tokens",
        choices=("last_block", "final_norm"),
        help="VLAD/ASMK: the backbone's patch tokens (default; XCiT: before class attention) or those after class "
        "attention and the final norm, which iBOT's patch head trains (docs/ibot.md)",
    )
    p.add_argument(
        "--local-dim", type=int, help="PCA dimension of local descriptors (default 128, as the paper)"
    )
    p.add_argument(
        "--local-whiten", type=float, help="whitening power of the local PCA: 0 plain (default), 0.5 full"
    )
    p.add_argument(
        "--multiscale", action="store_true", default=None, help="CLS: average scales 1, 1/sqrt2, 1/2"
    )
    p.add_argument(
        "--whiten", action="store_true", default=None, help="CLS: PCA-whiten (learnt on --train-images)"
    )
    p.add_argument("--pca-dim", type=int, help="CLS whitening dimension (default 128, Table D.4's CLS size)")
    p.add_argument(
        "--no-crop",
        dest="crop_queries",
        action="store_false",
        default=None,
        help="R-Oxford/Paris: use full query images instead of the bbx crop the protocol prescribes",
    )
    p.add_argument("--gnd", help="R-Oxford/Paris ground truth (default <data-root>/gnd_<dataset>.pkl)")
    p.add_argument("--rotations", help="Holidays: 'name angle' list for the rotation-corrected variant")
    p.add_argument("--vlad-power", type=float, help="VLAD signed power normalisation exponent (default 0.5)")
    p.add_argument("--no-intra-norm", dest="vlad_intra_norm", action="store_false", default=None)
    p.add_argument("--asmk-alpha", type=float, help="selective kernel exponent (default 3)")
    p.add_argument("--asmk-threshold", type=float, help="selective kernel threshold tau (default 0)")
    p.add_argument("--asmk-ma-query", type=int, help="query multiple assignment (default 5)")
    p.add_argument("--asmk-ma-db", type=int, help="database multiple assignment (default 1)")
    p.add_argument("--asmk-nobinary", dest="asmk_binary", action="store_false", default=None)
    p.add_argument("--kmeans-iters", type=int, help="k-means iterations (default 20)")
    p.add_argument("--max-train-descriptors", type=int, help="subsample for PCA/k-means (default 1,000,000)")
    p.add_argument("--seed", type=int)
    p.add_argument("--cache-dir", help="feature/PCA/codebook cache (default $SSL_XCIT_CACHE/features)")
    p.add_argument("--no-cache", action="store_true", default=None)
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--num-workers", type=int, help="image-decoding workers (default 0)")
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads; 1 is much faster than 2 on a machine other jobs share (default: torch's choice)",
    )
    p.add_argument("--output", help="write the results JSON here (atomic)")
    p.add_argument("--progress", action="store_true", default=None, help="print extraction progress")
    return p


def parse_config(argv: Sequence[str] | None) -> RetrievalConfig:
    args = vars(build_parser().parse_args(argv))
    values: dict = {}
    config_file = args.pop("config")
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"retrieval config not found: {path}")
        values = yaml.safe_load(path.read_text()) or {}
        known = {f.name for f in fields(RetrievalConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"unknown keys {unknown} in {path}; valid: {', '.join(sorted(known))}")
    values.update({k: v for k, v in args.items() if v is not None})
    if str(values.get("weights", "")).lower() == "none":
        values["weights"] = None
    missing = [k for k in ("dataset", "data_root") if not values.get(k)]
    if missing:
        raise SystemExit(f"ssl-xcit retrieval: missing --{', --'.join(m.replace('_', '-') for m in missing)}")
    if not values.get("weights") and not values.get("arch"):
        raise SystemExit(
            "ssl-xcit retrieval: give --weights (or --weights none with --arch for a random baseline)"
        )
    return RetrievalConfig(**values)


def main(argv: Sequence[str] | None = None) -> dict:
    config = parse_config(argv)
    result = run_retrieval(config)
    print(result["table"])
    if config.output:
        print(f"results written to {config.output}")
    return result
