"""Named XCiT variants (paper Table 1 and Table B.1) and :func:`create_model`."""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass

import torch

from ssl_xcit.models.xcit import XCiT


@dataclass(frozen=True)
class XCiTSize:
    """Shape of one XCiT family member.

    ``eta`` is the LayerScale init and ``supervised_drop_path`` the stochastic-depth rate of paper Table B.1
    (the supervised ImageNet recipe; DINO recipes set their own). ``tokens_norm`` follows the released
    checkpoints: every size but nano normalises all tokens in class attention.
    """

    embed_dim: int
    depth: int
    num_heads: int
    eta: float
    tokens_norm: bool
    supervised_drop_path: dict[int, float]


SIZES: dict[str, XCiTSize] = {
    "nano_12": XCiTSize(128, 12, 4, 1.0, False, {16: 0.0, 8: 0.0}),
    "tiny_12": XCiTSize(192, 12, 4, 1.0, True, {16: 0.0, 8: 0.0}),
    "tiny_24": XCiTSize(192, 24, 4, 1e-5, True, {16: 0.05, 8: 0.05}),
    "small_12": XCiTSize(384, 12, 8, 1.0, True, {16: 0.05, 8: 0.05}),
    "small_24": XCiTSize(384, 24, 8, 1e-5, True, {16: 0.1, 8: 0.1}),
    "medium_24": XCiTSize(512, 24, 8, 1e-5, True, {16: 0.15, 8: 0.15}),
    "large_24": XCiTSize(768, 24, 16, 1e-5, True, {16: 0.25, 8: 0.3}),
}
PATCH_SIZES = (16, 8)


def _name(size: str, patch: int) -> str:
    return f"xcit_{size}_p{patch}"


MODEL_CONFIGS: dict[str, dict] = {
    _name(size, patch): dict(
        patch_size=patch,
        embed_dim=spec.embed_dim,
        depth=spec.depth,
        num_heads=spec.num_heads,
        eta=spec.eta,
        tokens_norm=spec.tokens_norm,
    )
    for size, spec in SIZES.items()
    for patch in PATCH_SIZES
}


def list_models() -> list[str]:
    """The registered model names, smallest first."""
    return list(MODEL_CONFIGS)


def canonical_name(name: str) -> str:
    """Map a name (also timm's ``xcit_small_12_p16_224`` spelling) to a registered one, or raise a ValueError."""
    key = name.strip()
    for suffix in ("_224", "_384", "_448"):
        if key.endswith(suffix) and key[: -len(suffix)] in MODEL_CONFIGS:
            key = key[: -len(suffix)]
    if key not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(list_models())}")
    return key


def model_config(name: str) -> dict:
    """The constructor arguments of a registered variant."""
    return dict(MODEL_CONFIGS[canonical_name(name)])


def supervised_drop_path(name: str) -> float:
    """Stochastic-depth rate of paper Table B.1 for this variant."""
    key = canonical_name(name)
    size = key[len("xcit_") : key.rindex("_p")]
    return SIZES[size].supervised_drop_path[MODEL_CONFIGS[key]["patch_size"]]


def create_model(name: str, **overrides) -> XCiT:
    """Build a registered XCiT; ``overrides`` replace constructor arguments (e.g. ``drop_path_rate=0.1``).

    ``num_classes`` defaults to 0, so the model returns the CLS embedding. Pass ``device="meta"`` to build
    the structure without allocating weights (parameter counting).
    """
    key = canonical_name(name)
    config = model_config(key)
    device = overrides.pop("device", None)
    unknown = sorted(set(overrides) - set(inspect.signature(XCiT).parameters))
    if unknown:
        raise TypeError(f"create_model({key!r}) got unknown arguments {unknown}")
    config.update(overrides)
    config["name"] = key
    if device is not None:
        with torch.device(device):
            return XCiT(**config)
    return XCiT(**config)


def describe(name: str) -> dict:
    """Registry facts about a variant (shape, LayerScale init, Table B.1 drop path) for summaries."""
    key = canonical_name(name)
    size = key[len("xcit_") : key.rindex("_p")]
    info = asdict(SIZES[size])
    info.pop("supervised_drop_path")
    info.update(
        name=key, patch_size=MODEL_CONFIGS[key]["patch_size"], supervised_drop_path=supervised_drop_path(key)
    )
    return info
