"""The one registry of backbone names, for every family, and :func:`create_model`.

Each family lives in ``ssl_xcit/models/<family>.py`` and exposes

* ``VARIANTS: dict[str, dict]``: registered name -> constructor keyword arguments;
* one :class:`~ssl_xcit.models.base.Backbone` subclass (``MODEL_CLASS`` if the module defines several);
* optionally ``resolve_name(name) -> (variant, overrides) | None`` for aliases (timm's ``_224`` suffixes) and
  open-ended names (any timm ViT), ``infer_variant(state_dict)`` and ``convert_state_dict(state_dict)`` for
  checkpoint loading (the family's checkpoint filter, as timm's ``checkpoint_filter_fn``: it renames official
  keys and drops those the family recomputes, before ``load_pretrained`` compares keys strictly; a hook with a
  ``model`` parameter also gets the model the weights are for),
  ``describe_variant(name)`` for summaries.

Families are imported lazily from :data:`FAMILIES`; a family whose module is absent from this checkout is
skipped, so a new family only needs its module and its name in that tuple.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import Backbone

# Order of listing. Modules missing from a checkout are skipped (see _family_modules).
FAMILIES: tuple[str, ...] = ("xcit", "cait", "vit", "crossformerpp", "bixt", "dinov3", "convnext")


@dataclass(frozen=True)
class Entry:
    """A resolved name: its family, the class that builds it and the constructor arguments."""

    name: str
    family: str
    cls: type[Backbone]
    kwargs: dict


@cache
def _family_modules() -> dict[str, ModuleType]:
    modules = {}
    for family in FAMILIES:
        module_name = f"ssl_xcit.models.{family}"
        try:
            modules[family] = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:  # the family exists but one of its own imports is missing: say so
                raise
    return modules


def family_module(family: str) -> ModuleType:
    """The module of a registered family (``UserError`` naming the available ones otherwise)."""
    modules = _family_modules()
    if family not in modules:
        raise UserError(f"unknown backbone family {family!r}; available families: {', '.join(modules)}")
    return modules[family]


def family_class(family: str) -> type[Backbone]:
    """The Backbone subclass that builds a family's models."""
    module = family_module(family)
    cls = getattr(module, "MODEL_CLASS", None)
    if cls is None:
        own = [
            obj
            for obj in vars(module).values()
            if inspect.isclass(obj) and issubclass(obj, Backbone) and obj.__module__ == module.__name__
        ]
        if len(own) != 1:
            raise TypeError(
                f"family module {module.__name__} must define one Backbone subclass or MODEL_CLASS"
            )
        cls = own[0]
    return cls


def list_families() -> list[str]:
    """The families available in this installation, in listing order."""
    return list(_family_modules())


def list_models(family: str | None = None) -> list[str]:
    """Registered variant names (of one family if given), in family order, each family smallest first."""
    families = [family] if family is not None else list_families()
    return [name for f in families for name in family_module(f).VARIANTS]


def _unknown(name: str) -> UserError:
    """One line (the CLI prints one): the closest names, then every family with its variants."""
    import difflib

    families = _family_modules()
    names = [n for module in families.values() for n in module.VARIANTS]
    close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    listing = "; ".join(f"{family}: {', '.join(module.VARIANTS)}" for family, module in families.items())
    vit = " (vit also takes any plain timm ViT name, e.g. vit_small_patch16_224)" if "vit" in families else ""
    return UserError(f"unknown model {name!r}{hint}; families and their variants: {listing}{vit}")


def resolve(name: str) -> Entry:
    """Find ``name`` (or an alias a family accepts) in the registry; ``UserError`` listing all names if absent."""
    key = str(name).strip()
    for family, module in _family_modules().items():
        if key in module.VARIANTS:
            return Entry(key, family, family_class(family), dict(module.VARIANTS[key]))
    for family, module in _family_modules().items():
        resolver = getattr(module, "resolve_name", None)
        found = resolver(key) if resolver is not None else None
        if found is not None:
            variant, overrides = found
            base = dict(module.VARIANTS.get(variant, {}))
            return Entry(variant, family, family_class(family), {**base, **overrides})
    raise _unknown(name)


def canonical_name(name: str) -> str:
    """The registered name for ``name`` (aliases such as timm's ``xcit_small_12_p16_224`` resolved)."""
    return resolve(name).name


def family_of(name: str) -> str:
    """The family of a registered name."""
    return resolve(name).family


def model_config(name: str) -> dict:
    """The constructor arguments of a registered variant."""
    return dict(resolve(name).kwargs)


def create_model(name: str, **overrides) -> Backbone:
    """Build a registered backbone of any family; ``overrides`` replace constructor arguments.

    ``num_classes`` defaults to 0 in every family, so the model returns its global embedding. Pass
    ``device="meta"`` to build the structure without allocating weights (parameter and FLOP counting).
    """
    entry = resolve(name)
    device = overrides.pop("device", None)
    # YAML reads `{depth:4}` (no space after the colon) as the key "depth:4" with no value, and timm drops
    # arguments whose value is None: the setting would vanish without a word.
    bad = sorted(k for k in overrides if not str(k).isidentifier())
    if bad:
        raise UserError(
            f"backbone argument names {bad} are not names; in YAML write a space after each colon, "
            "e.g. {depth: 4, patch_size: 8}"
        )
    params = inspect.signature(entry.cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(overrides) - set(params))
    if unknown and not takes_any:
        raise TypeError(
            f"create_model({entry.name!r}) got unknown arguments {unknown}; {entry.cls.__name__} takes "
            f"{', '.join(p for p in params if p not in ('self', 'name'))}"
        )
    config = {**entry.kwargs, **overrides}
    if "num_classes" in params:  # a backbone by default, whatever the family's own default
        config.setdefault("num_classes", 0)
    if "name" in params:
        config["name"] = entry.name
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = entry.cls(**config)
    model.name = entry.name
    return model


# Families whose timm model gives no CLS and patch tokens as it is (a ConvNeXt's feature map, an Eva's mean pool).
_ADOPTED_FROM_TIMM = ("dinov3", "convnext")


def as_backbone(model: torch.nn.Module, spec: str) -> torch.nn.Module:
    """timm's DINOv3 ViT or ConvNeXt built from ``spec`` (``NAME[.TAG][@FILE]``) as our backbone of that name
    with the same tensors, which gives the final-norm CLS and patch tokens; any other model as it is."""
    arch = spec.partition("@")[0].partition(".")[0]
    try:
        entry = resolve(arch)
    except UserError:
        return model
    if entry.family not in _ADOPTED_FROM_TIMM:
        return model
    ours = create_model(arch)
    ours.load_state_dict(model.state_dict(), strict=True)
    return ours


def describe(name: str) -> dict:
    """Registry facts about a variant: family, constructor arguments and family-specific details."""
    entry = resolve(name)
    info = {"name": entry.name, "family": entry.family, **entry.kwargs}
    hook = getattr(family_module(entry.family), "describe_variant", None)
    if hook is not None:
        info.update(hook(entry.name))
    return info


def supervised_drop_path(name: str) -> float:
    """Stochastic-depth rate of the family's supervised recipe for this variant (XCiT Table B.1, CaiT Table 3)."""
    entry = resolve(name)
    hook = getattr(family_module(entry.family), "supervised_drop_path", None)
    if hook is None:
        raise UserError(f"{entry.family} records no supervised drop-path rate for {entry.name}")
    return hook(entry.name)
