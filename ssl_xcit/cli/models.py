"""``ssl-xcit models [NAME] [--input-size H W]``: list the backbones, or summarise one with a test forward."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from ssl_xcit.models import create_model, describe, list_models


def main(argv: Sequence[str] | None = None) -> dict | list[str]:
    parser = argparse.ArgumentParser(prog="ssl-xcit models", description=__doc__)
    parser.add_argument("name", nargs="?", help="a registered model; omit to list them all")
    parser.add_argument("--input-size", nargs=2, type=int, default=(224, 224), metavar=("H", "W"))
    args = parser.parse_args(argv)
    if args.name is None:
        rows = []
        for name in list_models():
            model = create_model(name, device="meta")
            params = sum(p.numel() for p in model.parameters()) / 1e6
            info = describe(name)
            rows.append(name)
            print(
                f"{name:22s} {params:7.2f}M params  dim {info['embed_dim']:4d}  depth {info['depth']:2d}  "
                f"heads {info['num_heads']:2d}  LayerScale {info['eta']:g}"
            )
        return rows
    model = create_model(args.name).eval()
    height, width = args.input_size
    x = torch.randn(1, 3, height, width)
    with torch.no_grad():
        tokens, grid = model.forward_patch_tokens(x)
        embedding = model(x)
    summary = dict(
        describe(args.name),
        params_millions=round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        input_size=[height, width],
        patch_grid=list(grid),
        patch_tokens=list(tokens.shape),
        cls_embedding=list(embedding.shape),
    )
    for key, value in summary.items():
        print(f"{key:22s} {value}")
    return summary
