"""``ssl-xcit visualize <kind>``: pictures of a backbone or a run, as PNGs and (``--html``) one HTML page.

ssl-xcit visualize attention --weights W --size 768 photo.jpg            # per-head attention maps
ssl-xcit visualize pca --weights W a.jpg b.jpg c.jpg                      # patch-token PCA as RGB
ssl-xcit visualize neighbours --weights W --train D/train --queries D/val # k nearest training images
ssl-xcit visualize retrieval --results retrieval.json                     # top-10 per query, marked
ssl-xcit visualize curves runs/quickstart                                 # training curves, collapse shaded

Without ``--weights``, ``--arch NAME`` draws a randomly initialised backbone (seeded by ``--seed``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ssl_xcit.errors import UserError

KINDS = ("attention", "pca", "neighbours", "retrieval", "curves")


def _common(parser: argparse.ArgumentParser, backbone: bool = True) -> None:
    parser.add_argument("--out", default="pictures", help="output folder for <kind>.png (and <kind>.html)")
    parser.add_argument("--html", action="store_true", help="also write one self-contained HTML page")
    parser.add_argument("--dpi", type=int, default=80, help="PNG resolution (dots per inch)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    if backbone:
        parser.add_argument(
            "--weights",
            default=None,
            help="a Lightning .ckpt (teacher), an exported state dict or official weights (any layout)",
        )
        parser.add_argument("--arch", default=None, help="registered backbone name; needed without --weights")
        parser.add_argument("--seed", type=int, default=0, help="seed of a random-init backbone")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssl-xcit visualize", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="kind", metavar="{" + ",".join(KINDS) + "}")
    p = sub.add_parser("attention", help="per-head attention of the global query over the image")
    _common(p)
    p.add_argument("images", nargs="+", help="image files")
    p.add_argument(
        "--size", type=int, default=224, help="longer side in px (any multiple of the patch, e.g. 768)"
    )
    p.add_argument("--layer", type=int, default=-1, help="attention block (default the last)")
    p.add_argument("--threshold", type=float, default=0.6, help="attention mass outlined on the mean map")
    p = sub.add_parser("pca", help="first three PCA components of the patch tokens as RGB, fitted jointly")
    _common(p)
    p.add_argument("images", nargs="+", help="image files (fitted together: parts match in colour)")
    p.add_argument("--size", type=int, default=224, help="longer side in px")
    p.add_argument("--threshold", type=float, default=0.5, help="background: first component below this")
    p.add_argument("--no-background", action="store_true", help="colour every patch (no thresholding)")
    p = sub.add_parser("neighbours", help="k nearest training images of queries (k-NN protocol)")
    _common(p)
    p.add_argument("--train", required=True, help="labelled training images (class subfolders)")
    p.add_argument("--queries", nargs="+", required=True, help="image files, or a labelled folder")
    p.add_argument(
        "--num-queries", type=int, default=5, help="queries taken from a folder (spread over classes)"
    )
    p.add_argument("--k", type=int, default=8, help="neighbours per query")
    p.add_argument("--per-class", type=int, default=None, help="at most this many training images per class")
    p.add_argument("--size", type=int, default=224, help="square input size")
    p.add_argument("--batch-size", type=int, default=32)
    p = sub.add_parser("retrieval", help="top-10 of each query, marked positive / junk / negative")
    _common(p)
    p.add_argument("--results", default=None, help="results JSON of `ssl-xcit retrieval --output`")
    p.add_argument(
        "--dataset", default=None, help="without --results: benchmark (holidays, ukbench, json, ...)"
    )
    p.add_argument("--data-root", default=None, help="without --results: the benchmark's folder or JSON")
    p.add_argument("--method", default="cls", help="without --results: cls, vlad or asmk")
    p.add_argument("--resolution", type=int, default=768, help="without --results: longer side in px")
    p.add_argument("--train-images", default=None, help="without --results: images for PCA/codebook")
    p.add_argument(
        "--gnd", default=None, help="without --results: revisited ground-truth pickle (default in root)"
    )
    p.add_argument("--cache-dir", default=None, help="descriptor cache (shared with `ssl-xcit retrieval`)")
    p.add_argument("--query", type=int, nargs="+", default=None, help="query indices (default the first 5)")
    p.add_argument("--top", type=int, default=10, help="results per query")
    p.add_argument("--setup", default="medium", help="revisited datasets: easy, medium or hard")
    p = sub.add_parser("curves", help="loss, lr, teacher temperature, k-NN, entropy, KL; collapse shaded")
    _common(p, backbone=False)
    p.add_argument("run", help="run folder holding a CSVLogger metrics.csv (or the file itself)")
    p.add_argument("--out-dim", type=int, default=None, help="prototypes K (default: the run's hparams.yaml)")
    return parser


def _backbone(args: argparse.Namespace):
    import torch

    from ssl_xcit.models import build_backbone

    if args.weights is None and args.arch is None:
        raise UserError("give --weights, or --arch NAME for a randomly initialised backbone")
    torch.manual_seed(args.seed)
    return build_backbone(args.weights, args.arch).eval()


def _queries(args, bank_classes: set[str]) -> tuple[list[Path], list[str | None]]:
    from ssl_xcit.visualize.neighbours import labelled_images

    if len(args.queries) == 1 and Path(args.queries[0]).is_dir():
        paths, labels = labelled_images(args.queries[0])
        # Evenly spread over the sorted folder, so every class gets queries.
        step = (len(paths) - 1) / max(1, args.num_queries - 1)
        pick = sorted({round(i * step) for i in range(args.num_queries)})
        return [paths[i] for i in pick], [labels[i] for i in pick]
    paths = [Path(q) for q in args.queries]
    return paths, [p.parent.name if p.parent.name in bank_classes else None for p in paths]


def render(args: argparse.Namespace) -> Path:
    """Draw ``args.kind`` and save it; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    from ssl_xcit.visualize import common

    show = not args.no_progress
    if args.kind == "attention":
        from ssl_xcit.visualize.attention import attention_figure, check_attention

        model = _backbone(args)
        check_attention(model)
        fig, _ = attention_figure(model, args.images, args.size, args.layer, args.threshold, show)
    elif args.kind == "pca":
        from ssl_xcit.visualize.pca import pca_figure

        threshold = None if args.no_background else args.threshold
        fig, _ = pca_figure(_backbone(args), args.images, args.size, threshold, show)
    elif args.kind == "neighbours":
        from ssl_xcit.visualize import neighbours as nb

        model = _backbone(args)
        bank_paths, bank_labels = nb.labelled_images(args.train, args.per_class)
        query_paths, query_labels = _queries(args, set(bank_labels))
        # A query found in the bank would be its own first neighbour: leave it out, as a held-out image.
        held_out = {p.resolve() for p in query_paths}
        kept = [i for i, p in enumerate(bank_paths) if p.resolve() not in held_out]
        bank_paths, bank_labels = [bank_paths[i] for i in kept], [bank_labels[i] for i in kept]
        bank = nb.embed(model, bank_paths, args.size, args.batch_size, show)
        queries = nb.embed(model, query_paths, args.size, args.batch_size, show)
        result = nb.find_neighbours(bank, bank_paths, bank_labels, queries, query_paths, query_labels, args.k)
        fig = nb.neighbours_figure(result)
    elif args.kind == "retrieval":
        from ssl_xcit.visualize import retrieval as rv

        if args.results:
            dataset, ranks, _ = rv.load_results(args.results)
        else:
            from ssl_xcit.retrieval import RetrievalConfig, load_dataset, run_retrieval

            if not (args.dataset and args.data_root):
                raise UserError(
                    "give --results JSON, or --dataset and --data-root (with --weights or --arch)"
                )
            config = RetrievalConfig(
                args.dataset,
                args.data_root,
                method=args.method,
                weights=args.weights,
                arch=args.arch,
                resolution=args.resolution,
                train_images=args.train_images,
                gnd=args.gnd,
                cache_dir=args.cache_dir,
                progress=show,
            )
            ranks = run_retrieval(config, _backbone(args))["top_ranks"]
            dataset = load_dataset(args.dataset, args.data_root, gnd_path=args.gnd)
        queries = args.query if args.query is not None else list(range(min(5, len(ranks))))
        fig, _ = rv.retrieval_figure(dataset, ranks, queries, args.top, args.setup)
    else:
        from ssl_xcit.visualize.curves import curves_figure, read_metrics

        fig = curves_figure(read_metrics(args.run, args.out_dim))
    png = common.save_figure(fig, Path(args.out) / f"{args.kind}.png", dpi=args.dpi)
    if args.html:
        page = Path(args.out) / f"{args.kind}.html"
        page.write_text(common.html_page(f"ssl-xcit visualize {args.kind}", [(args.kind, png)]))
    return png


def main(argv: Sequence[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    if args.kind is None:
        raise SystemExit(f"ssl-xcit visualize: give a kind, one of {', '.join(KINDS)}")
    from ssl_xcit.models.base import AttentionNotSupported

    try:
        png = render(args)
    except (UserError, FileNotFoundError, AttentionNotSupported) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(f"ssl-xcit visualize {args.kind}: {first}") from error
    print(f"wrote {png}" + (f" and {png.with_suffix('.html')}" if args.html else ""))
    return png
