"""Load XCiT weights from any of the layouts users have on disk.

Accepted sources, all through :func:`load_pretrained`:

* plain state dicts in our (= timm's) naming, e.g. from ``ssl-xcit export`` or ``timm_model.state_dict()``;
* the official XCiT/DINO naming: ``pos_embeder.*`` and a fused class-attention ``qkv`` (split into q, k, v);
* wrapper prefixes ``module.`` (DDP) and ``backbone.`` (DINO's MultiCropWrapper);
* containers ``teacher`` / ``student`` / ``model`` / ``state_dict`` (the teacher is preferred: DINO evaluates it);
* our Lightning checkpoints, whose ``state_dict`` holds ``teacher.backbone.*`` and whose ``hyper_parameters``
  name the backbone.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ssl_xcit.models.registry import SIZES, canonical_name, create_model
from ssl_xcit.models.xcit import XCiT

# Keys that belong to a DINO projection head or a classifier, never to the backbone.
_HEAD_KEY = re.compile(r"^(head\.(mlp|last_layer)\.|head\.(weight|bias)$)")
_CONTAINERS = ("teacher", "model", "state_dict", "student")


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did: keys the model kept at init, and checkpoint keys it did not use."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    dropped_head: list[str] = field(default_factory=list)
    source: str = ""

    def __str__(self) -> str:
        return (
            f"loaded {self.source or 'state dict'}: {len(self.missing)} missing keys {self.missing[:8]}, "
            f"{len(self.unexpected)} unexpected keys {self.unexpected[:8]}, {len(self.dropped_head)} head keys dropped"
        )


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """``torch.load`` on CPU with a clear error for a missing or unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as safe_error:  # noqa: BLE001 - retried below with a full unpickler
        # Lightning checkpoints can hold pickled hyper-parameters (paths, enums) that the weights-only unpickler
        # refuses. The user named this file explicitly, so the full unpickler is acceptable here.
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error:
            raise ValueError(
                f"cannot read checkpoint {path}: {error} (weights-only load said: {safe_error})"
            ) from error


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, Tensor) for v in obj.values())


def extract_state_dict(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Tensor], str | None]:
    """Find the backbone weights inside a checkpoint; returns ``(state_dict, model_name_hint)``."""
    name = None
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    if isinstance(hparams, Mapping) and isinstance(hparams.get("backbone"), str):
        name = hparams["backbone"]
    state: Any = checkpoint
    for _ in range(3):  # containers can nest, e.g. {"state_dict": {"teacher.backbone.x": ...}}
        if _is_tensor_dict(state):
            break
        key = next((k for k in _CONTAINERS if isinstance(state, Mapping) and k in state), None)
        if key is None:
            break
        state = state[key]
    if not _is_tensor_dict(state):
        keys = list(checkpoint)[:10] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise ValueError(
            f"no state dict found in checkpoint (top-level keys: {keys}); expected a tensor dict or one under "
            f"{', '.join(repr(c) for c in _CONTAINERS)}"
        )
    state = dict(state)
    # A Lightning DINO checkpoint holds student and teacher side by side: keep the teacher.
    for prefix in ("teacher.", "student."):
        if any(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            break
    return state, name


def convert_state_dict(
    state_dict: Mapping[str, Tensor], model: XCiT | None = None
) -> tuple[dict[str, Tensor], list[str]]:
    """Translate official/DINO naming into ours; returns ``(state_dict, dropped_head_keys)``.

    Head keys are dropped when the model has no classifier (``num_classes == 0``) or when they belong to a DINO
    projection head.
    """
    out: dict[str, Tensor] = {}
    dropped: list[str] = []
    keep_classifier = model is not None and model.num_classes > 0
    for key, value in state_dict.items():
        for prefix in ("module.", "backbone.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix) :]
        if key.startswith("pos_embeder."):
            key = "pos_embed." + key[len("pos_embeder.") :]
        if _HEAD_KEY.match(key) and not (keep_classifier and key in ("head.weight", "head.bias")):
            dropped.append(key)
            continue
        fused = re.match(r"^(cls_attn_blocks\.\d+\.attn\.)qkv\.(weight|bias)$", key)
        if fused:
            for part, chunk in zip(("q", "k", "v"), value.chunk(3, dim=0), strict=True):
                out[f"{fused.group(1)}{part}.{fused.group(2)}"] = chunk.clone()
            continue
        out[key] = value
    return out, dropped


def load_pretrained(
    model: XCiT, source: str | os.PathLike | Mapping[str, Any], strict: bool = True
) -> LoadReport:
    """Load weights from a path or a checkpoint dict into ``model``.

    Raises ``FileNotFoundError`` for a missing path, ``ValueError`` naming keys and both shapes on any shape
    mismatch, and (with ``strict``) ``ValueError`` naming the missing and unexpected keys.
    """
    label = str(source) if isinstance(source, (str, os.PathLike)) else "state dict"
    checkpoint = read_checkpoint(source) if isinstance(source, (str, os.PathLike)) else source
    raw, _ = extract_state_dict(checkpoint)
    state, dropped = convert_state_dict(raw, model)
    own = model.state_dict()
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    if mismatched:
        raise ValueError(
            f"checkpoint {label} does not fit {model.name}: {len(mismatched)} tensors have the wrong shape:\n  "
            + "\n  ".join(mismatched[:20])
            + ("\n  ..." if len(mismatched) > 20 else "")
            + f"\n(the checkpoint looks like {infer_model_name(state) or 'an unknown architecture'})"
        )
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    report = LoadReport(missing=missing, unexpected=unexpected, dropped_head=dropped, source=label)
    if strict and (missing or unexpected):
        raise ValueError(
            f"checkpoint {label} does not match {model.name}: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}"
        )
    model.load_state_dict(state, strict=False)
    if missing or unexpected:
        warnings.warn(str(report), stacklevel=2)
    return report


def infer_architecture(state_dict: Mapping[str, Tensor]) -> tuple[str, dict[str, int]] | None:
    """``(registered name, overrides)`` matching the tensor shapes, or ``None`` if it is no XCiT.

    Width, heads and patch size pick the family member; a depth other than the registered one (a truncated
    model, e.g. ``depth=4``) comes back as an override.
    """
    state, _ = convert_state_dict(state_dict)
    token = state.get("cls_token")
    if token is None:
        return None
    width = token.shape[-1]
    depth = 1 + max((int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    convs = {int(m.group(1)) for k in state if (m := re.match(r"patch_embed\.proj\.(\d+)\.0\.weight", k))}
    patch = {4: 16, 3: 8}.get(len(convs))
    temperature = state.get("blocks.0.attn.temperature")
    heads = temperature.shape[0] if temperature is not None else None
    candidates = [
        size for size, spec in SIZES.items() if spec.embed_dim == width and heads in (None, spec.num_heads)
    ]
    if patch is None or depth < 1 or not candidates:
        return None
    exact = [size for size in candidates if SIZES[size].depth == depth]
    size = exact[0] if exact else min(candidates, key=lambda c: abs(SIZES[c].depth - depth))
    overrides = {} if exact else {"depth": depth}
    return f"xcit_{size}_p{patch}", overrides


def infer_model_name(state_dict: Mapping[str, Tensor]) -> str | None:
    """The registered variant whose shapes the state dict has exactly, or ``None``."""
    found = infer_architecture(state_dict)
    return found[0] if found is not None and not found[1] else None


def _describe(name: str, overrides: Mapping[str, Any]) -> str:
    return name + "".join(f" with {k}={v}" for k, v in sorted(overrides.items()))


def build_backbone(weights: str | os.PathLike | None, name: str | None = None, **overrides) -> XCiT:
    """Build a backbone and load ``weights`` into it.

    The architecture is ``name`` if given, else the one recorded in a Lightning checkpoint (``backbone`` and
    ``backbone_kwargs`` hyper-parameters), else the one inferred from tensor shapes. A checkpoint of another
    architecture than ``name`` raises a ValueError naming both. With ``weights=None`` a randomly initialised
    ``name`` is returned (a baseline).
    """
    if weights is None:
        if name is None:
            raise ValueError("build_backbone needs a model name when no weights are given")
        return create_model(name, **overrides)
    checkpoint = read_checkpoint(weights)
    state, hinted = extract_state_dict(checkpoint)
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    hinted_kwargs = dict((hparams or {}).get("backbone_kwargs") or {}) if hinted else {}
    inferred = infer_architecture(state)
    found = (canonical_name(hinted), hinted_kwargs) if hinted else inferred
    if name is not None:
        wanted = (canonical_name(name), {k: v for k, v in overrides.items() if k == "depth"})
        if found is not None and (found[0], {k: v for k, v in found[1].items() if k == "depth"}) != wanted:
            raise ValueError(
                f"checkpoint {weights} holds a {_describe(*found)} backbone, but {_describe(*wanted)} was requested"
            )
        arch_kwargs = dict(found[1]) if found is not None else {}
    elif found is None:
        raise ValueError(
            f"cannot tell the architecture of {weights}: pass the model name explicitly (e.g. --arch xcit_small_12_p16)"
        )
    else:
        name, arch_kwargs = found
    model = create_model(name, **{**arch_kwargs, **overrides})
    load_pretrained(model, checkpoint, strict=True)
    return model
