"""Load backbone weights (any registered family) from any of the layouts users have on disk.

Accepted sources, all through :func:`load_pretrained`:

* plain state dicts in our (= timm's) naming, e.g. from ``ssl-xcit export`` or ``timm_model.state_dict()``, in
  torch's pickle format or as ``.safetensors`` (whose metadata, written by ``ssl-xcit export``, names the backbone);
* the official XCiT/DINO naming: ``pos_embeder.*`` and a fused class-attention ``qkv`` (split into q, k, v);
* official BiXT and CrossFormer v1 state dicts, whose buffers for one input size (``fourier_pos_encode.pos``,
  ``attn.biases``, ``attn.relative_position_index``) are dropped: those families recompute them per input;
* wrapper prefixes ``module.`` (DDP) and ``backbone.`` (DINO's MultiCropWrapper);
* containers ``teacher`` / ``student`` / ``model`` / ``state_dict`` (the teacher is preferred: DINO evaluates it);
* our Lightning checkpoints, whose ``state_dict`` holds ``teacher.backbone.*`` and whose ``hyper_parameters``
  name the backbone; ``ssl-xcit export`` files, which record the name and ``backbone_kwargs`` the same way.

Without a recorded name the family is inferred from the state dict's keys (each family's ``infer_variant``
hook, else an exact shape match against its variants), so a checkpoint of another family is reported by name.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ssl_xcit.errors import UserError
from ssl_xcit.models import registry
from ssl_xcit.models.base import Backbone
from ssl_xcit.models.registry import create_model, family_module, list_families, resolve
from ssl_xcit.models.safe_load import read_checkpoint_file, safe_globals

_safe_globals = safe_globals  # the name earlier releases exported

# DINO projection heads (`head.mlp`, `head.last_layer`; iBOT's `patch_head.*`) and classifier heads.
# Feature distillation's projections (`head.cls_proj`, `head.patch_proj`: ssl_xcit.dino.distill) are heads too,
# and so are Meta's DINOv2/DINOv3 training heads (`dino_head.*`, `ibot_head.*`: dinov3/train/ssl_meta_arch.py).
_HEAD_KEY = re.compile(
    r"^((patch_)?head\.(mlp|last_layer)\.|head\.(weight|bias)$|head\.(cls|patch)_proj\.|(dino|ibot)_head\.)"
)
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


def read_checkpoint(path: str | os.PathLike, trust: bool = False) -> Any:
    """A checkpoint file (:func:`ssl_xcit.models.safe_load.read_checkpoint_file`: weights-only unpickling,
    ``trust`` for the full unpickler) or a folder of FSDP2 shards (``ssl_xcit.models.sharded``), on the CPU."""
    from ssl_xcit.models.sharded import is_sharded_checkpoint, read_sharded_checkpoint

    if is_sharded_checkpoint(path):
        return read_sharded_checkpoint(path, trust)
    return read_checkpoint_file(path, trust)


def read_backbone_checkpoint(path: str | os.PathLike, trust: bool = False) -> dict[str, Any]:
    """:func:`read_checkpoint` for readers of one backbone: a sharded folder gives ``meta.pt``'s entries and
    only the evaluated network's backbone tensors (``ssl_xcit.models.sharded.read_sharded_backbone``), never
    the optimiser state or the other networks; any other source is read whole, as by :func:`read_checkpoint`."""
    from ssl_xcit.models.sharded import is_sharded_checkpoint, read_sharded_backbone

    if is_sharded_checkpoint(path):
        return read_sharded_backbone(path, trust)
    return read_checkpoint(path, trust)


def is_tensor_dict(obj: Any) -> bool:
    """A non-empty mapping of tensors: a state dict, as opposed to a checkpoint that holds one."""
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, Tensor) for v in obj.values())


def extract_state_dict(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Tensor], str | None]:
    """Find the backbone weights inside a checkpoint; returns ``(state_dict, model_name_hint)``."""
    name = None
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    if isinstance(hparams, Mapping) and isinstance(hparams.get("backbone"), str):
        name = hparams["backbone"]
    state: Any = checkpoint
    for _ in range(3):  # containers can nest, e.g. {"state_dict": {"teacher.backbone.x": ...}}
        if is_tensor_dict(state):
            break
        key = next((k for k in _CONTAINERS if isinstance(state, Mapping) and k in state), None)
        if key is None:
            break
        state = state[key]
    if not is_tensor_dict(state):
        keys = list(checkpoint)[:10] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise UserError(
            f"no state dict found in checkpoint (top-level keys: {keys}); expected a tensor dict or one under "
            f"{', '.join(repr(c) for c in _CONTAINERS)}"
        )
    state = dict(state)
    # A Lightning DINO checkpoint holds student and teacher side by side: keep the teacher. A distillation
    # checkpoint has none: its student EMA (the dinov3 objective's evaluated network), else its student.
    for prefix in ("teacher.", "student_ema.", "student."):
        if any(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            break
    return state, name


def convert_state_dict(
    state_dict: Mapping[str, Tensor], model: Backbone | None = None
) -> tuple[dict[str, Tensor], list[str]]:
    """Translate official/DINO naming into ours; returns ``(state_dict, dropped_head_keys)``.

    Head keys are dropped when the model has no classifier (``num_classes == 0``) or when they belong to a DINO
    projection head. Family checkpoint filters (``convert_state_dict`` hooks: XCiT's official layout via timm's
    filter, the size-bound buffers BiXT and CrossFormer drop) run for the model's family, or for every family
    when no model is given.
    """
    out: dict[str, Tensor] = {}
    dropped: list[str] = []
    keep_classifier = model is not None and getattr(model, "num_classes", 0) > 0
    for key, value in state_dict.items():
        for prefix in ("module.", "backbone.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix) :]
        if _HEAD_KEY.match(key) and not (keep_classifier and key in ("head.weight", "head.bias")):
            dropped.append(key)
            continue
        if key == "mask_token" and getattr(model, "mask_token", None) is None:
            # iBOT/DINOv2's training-only mask token (our iBOT runs, official DINOv2 weights).
            dropped.append(key)
            continue
        out[key] = value
    families = [model.family] if model is not None and model.family in list_families() else list_families()
    for family in families:
        hook = getattr(family_module(family), "convert_state_dict", None)
        if hook is not None:
            out = hook(out, model) if "model" in inspect.signature(hook).parameters else hook(out)
    return out, dropped


def load_pretrained(
    model: Backbone, source: str | os.PathLike | Mapping[str, Any], strict: bool = True, trust: bool = False
) -> LoadReport:
    """Load weights from a path or a checkpoint dict into ``model``.

    Raises ``FileNotFoundError`` for a missing path, ``UserError`` naming keys and both shapes on any shape
    mismatch, and (with ``strict``) ``UserError`` naming the missing and unexpected keys.
    """
    label = str(source) if isinstance(source, (str, os.PathLike)) else "state dict"
    checkpoint = read_backbone_checkpoint(source, trust) if isinstance(source, (str, os.PathLike)) else source
    raw, _ = extract_state_dict(checkpoint)
    state, dropped = convert_state_dict(raw, model)
    family = infer_family(state)
    if family is not None and family != model.family:
        raise UserError(
            f"checkpoint {label} holds a {family} backbone, but the model {model.name} is a {model.family} "
            f"backbone; build a {family} model (e.g. build_backbone(weights) infers it)"
        )
    own = model.state_dict()
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    if mismatched:
        raise UserError(
            f"checkpoint {label} does not fit {model.name}: {len(mismatched)} tensors have the wrong shape:\n  "
            + "\n  ".join(mismatched[:20])
            + ("\n  ..." if len(mismatched) > 20 else "")
            + f"\n(the checkpoint looks like {infer_model_name(state) or 'an unknown architecture'})"
        )
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    report = LoadReport(missing=missing, unexpected=unexpected, dropped_head=dropped, source=label)
    if strict and (missing or unexpected):
        raise UserError(
            f"checkpoint {label} does not match {model.name}: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}"
        )
    model.load_state_dict(state, strict=False)
    if missing or unexpected:
        warnings.warn(str(report), stacklevel=2)
    return report


# A variant's parameter shapes depend only on its class and constructor arguments. Meta-building every variant of
# a family again for each checkpoint took seconds (CrossFormer++'s and BiXT's initialisers run on meta tensors
# too), so they are built once per process; the key holds class and arguments, so a variant registered later
# under the same name with other arguments is built anew.
_VARIANT_SHAPES: dict[tuple[type, str, str], dict[str, tuple[int, ...]]] = {}


def _variant_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """Parameter and buffer shapes of a registered variant, built on the meta device once per process."""
    entry = registry.resolve(name)
    key = (entry.cls, entry.name, repr(sorted(entry.kwargs.items())))
    if key not in _VARIANT_SHAPES:
        own = create_model(name, device="meta").state_dict()
        _VARIANT_SHAPES[key] = {k: tuple(v.shape) for k, v in own.items()}
    return _VARIANT_SHAPES[key]


def _shape_match(family: str, state: Mapping[str, Tensor]) -> tuple[str, dict] | None:
    """The first variant of ``family`` whose state dict has exactly these keys and shapes (meta-built)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    for name in registry.list_models(family):
        if _variant_shapes(name) == shapes:
            return name, {}
    return None


def infer_architecture(state_dict: Mapping[str, Tensor]) -> tuple[str, dict[str, Any]] | None:
    """``(registered name, overrides)`` matching the tensor shapes, or ``None`` if no family recognises them.

    Each family's ``infer_variant`` hook picks the variant (a truncated depth comes back as an override);
    families without one are matched exactly on their variants' shapes.
    """
    state, _ = convert_state_dict(state_dict)
    # Families with a hook first: a hook looks at a few keys, while an exact match builds every variant of its
    # family (seconds, once per process), which a checkpoint a hook recognises never needs.
    families = sorted(list_families(), key=lambda f: getattr(family_module(f), "infer_variant", None) is None)
    for family in families:
        hook = getattr(family_module(family), "infer_variant", None)
        found = hook(state) if hook is not None else _shape_match(family, state)
        if found is not None:
            return found
    return None


def _key_pattern(keys: Any) -> set[str]:
    return {re.sub(r"\.\d+\.", ".#.", k) for k in keys}


def infer_family(state_dict: Mapping[str, Tensor]) -> str | None:
    """The family a state dict belongs to: by ``infer_architecture``, else by parameter-name overlap (at least
    half of the names, block indices ignored) with a family's smallest variant; ``None`` if unrecognised."""
    found = infer_architecture(state_dict)
    if found is not None:
        return resolve(found[0]).family
    keys = _key_pattern(convert_state_dict(state_dict)[0])
    best, score = None, 0.5
    for family in list_families():
        names = registry.list_models(family)
        if not names:
            continue
        ref = _key_pattern(_variant_shapes(names[0]))
        overlap = len(keys & ref) / max(len(keys | ref), 1)
        if overlap >= score:
            best, score = family, overlap
    return best


def infer_model_name(state_dict: Mapping[str, Tensor]) -> str | None:
    """The registered variant whose shapes the state dict has exactly, or ``None``."""
    found = infer_architecture(state_dict)
    return found[0] if found is not None and not found[1] else None


def _describe(name: str, overrides: Mapping[str, Any]) -> str:
    return name + "".join(f" with {k}={v}" for k, v in sorted(overrides.items()))


def build_backbone(
    weights: str | os.PathLike | None, name: str | None = None, trust: bool = False, **overrides
) -> Backbone:
    """Build a backbone and load ``weights`` into it.

    The architecture is ``name`` if given, else the one recorded in the checkpoint (``backbone`` and
    ``backbone_kwargs`` hyper-parameters of a Lightning checkpoint or an ``ssl-xcit export`` file), else the one
    inferred from tensor shapes. A checkpoint of another architecture than ``name`` raises a UserError naming
    both (and both families when they differ). With ``weights=None`` a randomly initialised ``name`` is returned.
    """
    if weights is None:
        if name is None:
            raise UserError("build_backbone needs a model name when no weights are given")
        return create_model(name, **overrides)
    return backbone_from_checkpoint(read_backbone_checkpoint(weights, trust), weights, name, **overrides)


def backbone_from_checkpoint(
    checkpoint: Mapping[str, Any], weights: str | os.PathLike, name: str | None = None, **overrides
) -> Backbone:
    """:func:`build_backbone` from a checkpoint already read (``weights`` names it in errors)."""
    state, hinted = extract_state_dict(checkpoint)
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    hinted_kwargs = dict((hparams or {}).get("backbone_kwargs") or {}) if hinted else {}
    found = (resolve(hinted).name, hinted_kwargs) if hinted else infer_architecture(state)
    if name is not None:
        wanted = (resolve(name).name, {k: v for k, v in overrides.items() if k == "depth"})
        if found is not None and (found[0], {k: v for k, v in found[1].items() if k == "depth"}) != wanted:
            have, want = resolve(found[0]).family, resolve(name).family
            families = f" (a {have} checkpoint, not {want})" if have != want else ""
            raise UserError(
                f"checkpoint {weights} holds a {_describe(*found)} backbone, but {_describe(*wanted)} was "
                f"requested{families}"
            )
        if found is None and (family := infer_family(state)) is not None and family != resolve(name).family:
            raise UserError(
                f"checkpoint {weights} holds a {family} backbone, but {name} is a {resolve(name).family} model"
            )
        arch_kwargs = dict(found[1]) if found is not None else {}
    elif found is None:
        raise UserError(
            f"cannot tell the architecture of {weights} (no registered family matches its keys): pass the model "
            f"name explicitly (e.g. --arch xcit_small_12_p16); families: {', '.join(list_families())}"
        )
    else:
        name, arch_kwargs = found
    model = create_model(name, **{**arch_kwargs, **overrides})
    load_pretrained(model, checkpoint, strict=True)
    return model
