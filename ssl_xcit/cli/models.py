"""``ssl-xcit models [NAME] [--family F] [--input-size H W]``: list every registered backbone with its parameters
and GMACs at 224 px, or summarise one with a test forward.

Counts use ``torch.utils.flop_counter.FlopCounterMode`` on the meta device (no weights are allocated): it counts
matrix multiplications and convolutions, as fvcore does for the papers' tables; GMACs = FLOPs / 2. Parameters
are those of the headless backbone (``num_classes=0``), the one DINO trains.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from ssl_xcit.models import create_model, describe, family_of, list_families, list_models


def count_gmacs(name: str, height: int = 224, width: int = 224, **overrides) -> float:
    """Multiply-accumulates (in G) of one forward at batch 1, counted on the meta device."""
    model = create_model(name, device="meta", **overrides).eval().requires_grad_(False)
    x = torch.empty(1, 3, height, width, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() / 2e9


def count_params(name: str, **overrides) -> int:
    return sum(p.numel() for p in create_model(name, device="meta", **overrides).parameters())


def table_row(name: str) -> dict:
    """Name, family, parameters (M) and GMACs at 224 of a registered variant."""
    model = create_model(name, device="meta")
    return {
        "name": name,
        "family": family_of(name),
        "params_millions": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "gmacs_224": round(count_gmacs(name), 2),
        "embed_dim": model.embed_dim,
        "dense_dim": model.dense_dim,
        "size_multiple": model.size_multiple,
    }


def main(argv: Sequence[str] | None = None) -> dict | list[dict]:
    parser = argparse.ArgumentParser(prog="ssl-xcit models", description=__doc__)
    parser.add_argument("name", nargs="?", help="a registered model; omit to list them all")
    parser.add_argument("--family", choices=list_families(), help="list only this family")
    parser.add_argument("--input-size", nargs=2, type=int, default=(224, 224), metavar=("H", "W"))
    args = parser.parse_args(argv)
    if args.name is None:
        rows = []
        print(
            f"{'name':26s} {'family':14s} {'params':>9s} {'GMACs@224':>10s} {'dim':>5s} {'dense':>6s} {'multiple':>8s}"
        )
        for name in list_models(args.family):
            row = table_row(name)
            rows.append(row)
            print(
                f"{name:26s} {row['family']:14s} {row['params_millions']:8.2f}M {row['gmacs_224']:10.2f} "
                f"{row['embed_dim']:5d} {row['dense_dim']:6d} {row['size_multiple']:8d}",
                flush=True,
            )
        return rows
    height, width = args.input_size
    model = create_model(args.name).eval()
    model.check_input(torch.empty(1, 3, height, width, device="meta"))
    x = torch.randn(1, 3, height, width)
    with torch.no_grad():
        tokens, grid = model.forward_patch_tokens(x)
        embedding = model(x)
    summary = dict(
        describe(args.name),
        params_millions=round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        gmacs=round(count_gmacs(args.name, height, width), 3),
        input_size=[height, width],
        dense_grid=list(grid),
        dense_tokens=list(tokens.shape),
        embedding=list(embedding.shape),
        has_attention_maps=model.has_attention_maps,
    )
    for key, value in summary.items():
        print(f"{key:22s} {value}")
    return summary
