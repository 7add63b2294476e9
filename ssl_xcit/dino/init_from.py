"""Start a DINO run from pretrained weights: ``--model.init_from SOURCE`` (continued pretraining).

SOURCE is one of

* a checkpoint of ours (``.ckpt``): student, teacher, their DINO and patch heads and the loss centres. A
  distillation checkpoint (``ssl_xcit.dino.distill``) saves no teacher: its student EMA (``dinov3``) or else
  its student stands for the teacher, and a ``features`` run's linear projections, not a DINO head, are left
  out (the head starts fresh);
* the official DINO full checkpoint (``{"student", "teacher", "dino_loss", ...}``, ``module.`` prefixes);
* Meta's DINOv2/DINOv3 training checkpoints: a gathered training folder (``ssl-xcit gather-checkpoint``:
  ``model`` with ``student.*`` and ``teacher.*``, their heads named ``dino_head`` and ``ibot_head``) or an eval
  ``teacher_checkpoint.pth`` (``{"teacher": {backbone.*, dino_head.*, ibot_head.*}}``, both networks from it);
  DINOv3's heads have a plain last layer (``--model.head_last_layer linear``);
* any backbone-only file :func:`ssl_xcit.models.checkpoint.load_pretrained` reads: ``ssl-xcit export``
  output (``.safetensors``, ``.pth``), DINO's ``*_pretrain.pth``, timm state dicts;
* ``timm:NAME`` (timm's pretrained weights, downloaded by timm) or ``timm:NAME@FILE`` (the same weights from a
  local file, read by timm through ``pretrained_cfg_overlay``).

Student and teacher backbones start from SOURCE (each from its own side when SOURCE has both, or both from its
teacher with ``--model.init_from_ema true``, as DINOv3's ``resume_from_teacher_chkpt``); the heads and
the centres are loaded when SOURCE has them, so an official full checkpoint continues as its run would have.
A head trained with ``norm_last_layer`` false (official ViT-S/XCiT runs: their ``args``; ours: the recorded
hyperparameters) has a learnt weight norm, which a model with ``norm_last_layer`` true would keep frozen at the
loaded values: that is refused in one line naming the setting.
A head SOURCE lacks (the DINO head, iBOT's patch head, any other) starts fresh, and the backbone gets no
update for the first ``head_warmup_steps`` optimiser steps (:func:`drop_backbone_gradients`): a random head's
first gradients would otherwise move the pretrained backbone. Every tensor of the model must come from SOURCE
except the fresh heads and iBOT's mask
token (training-only, absent from released backbones); anything else that does not fit is refused in one line.

This is not ``--ckpt_path``: the optimiser, the step and the schedules start fresh. The weights are loaded at
``on_fit_start`` of a fresh run only; a run resumed with ``--ckpt_path`` keeps its checkpoint's weights and
never reads SOURCE again.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from ssl_xcit.errors import UserError
from ssl_xcit.models.checkpoint import (
    convert_state_dict,
    extract_state_dict,
    infer_architecture,
    is_tensor_dict,
    read_checkpoint,
)
from ssl_xcit.models.registry import resolve
from ssl_xcit.models.sharded import (
    is_checkpoint,
    is_sharded_checkpoint,
    model_keys,
    read_index,
    read_meta,
    read_sharded_checkpoint,
)
from ssl_xcit.parallel.fsdp import load_whole_state

TIMM_PREFIX = "timm:"
# Optimiser steps during which a fresh head trains alone on a pretrained backbone (init_head_warmup_steps=None).
AUTO_HEAD_WARMUP_STEPS = 50
# Model tensors SOURCE may lack: iBOT's mask token (training-only; released backbones have none).
_MAY_BE_FRESH = ("mask_token",)
_PARTS = ("backbone", "head", "patch_head")
# Meta's DINOv2/DINOv3 training code names the heads of a network ``dino_head`` and ``ibot_head``
# (dinov3/train/ssl_meta_arch.py: ``student``/``teacher`` ModuleDicts); ours are ``head`` and ``patch_head``.
_META_PARTS = {"dino_head": "head", "ibot_head": "patch_head"}
_CENTRES = ("dino_loss.center", "ibot_loss.center")


@dataclass
class InitWeights:
    """The tensors SOURCE holds, by MultiCropWrapper part (``backbone``, ``head``, ``patch_head``) for the
    student and the teacher, plus the loss centres; backbone keys still in SOURCE's own naming."""

    label: str
    student: dict[str, dict[str, Tensor]]
    teacher: dict[str, dict[str, Tensor]]
    centres: dict[str, Tensor] = field(default_factory=dict)
    norm_last_layer: bool | None = None  # the heads' setting, where SOURCE records it


def _strip(state: Mapping[str, Tensor], prefixes: tuple[str, ...] = ("module.", "_orig_mod.")) -> dict:
    out = {}
    for key, value in state.items():
        for prefix in prefixes:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def _wrapper_parts(state: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """A MultiCropWrapper state (``backbone.*``, ``head.*``, ``patch_head.*``) split by part; a bare backbone
    state (no ``backbone.`` key) is all backbone."""
    state = _strip(state)
    if not any(k.startswith("backbone.") for k in state):
        return {"backbone": state}
    parts: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        part, _, rest = key.partition(".")
        part = _META_PARTS.get(part, part)
        if part not in _PARTS:
            raise UserError(f"unexpected key {key!r} beside backbone.* in a DINO network state")
        parts.setdefault(part, {})[rest] = value
    return parts


def _dino_heads_only(parts: dict[str, dict[str, Tensor]]) -> dict[str, dict[str, Tensor]]:
    """``parts`` without a head that is not a DINO head (a ``features`` distillation's linear projections)."""
    return {
        part: state
        for part, state in parts.items()
        if part == "backbone" or any(k.startswith("last_layer.") for k in state)
    }


def _recorded_norm_last_layer(checkpoint: Mapping[str, Any]) -> bool | None:
    """``norm_last_layer`` as SOURCE records it: our hyperparameters, or an official run's ``args``."""
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, Mapping) and isinstance(hparams.get("norm_last_layer"), bool):
        return hparams["norm_last_layer"]
    args = checkpoint.get("args")
    value = (
        args.get("norm_last_layer") if isinstance(args, Mapping) else getattr(args, "norm_last_layer", None)
    )
    if isinstance(value, str):  # DINO's utils.bool_flag values, should a file hold the raw text
        value = {"true": True, "false": False, "1": True, "0": False}.get(value.strip().lower())
    return value if isinstance(value, bool) else None


def nest_meta_layout(checkpoint: Any) -> Any:
    """A gathered DINOv2/DINOv3 training checkpoint flattened to ``model.*`` keys (one tensor per key, as a
    safetensors file holds it) nested back under ``model``, as dinov3/checkpointer saves it (a DCP of
    ``{"model": ..., "optimizer": ...}``); anything else unchanged."""
    if not isinstance(checkpoint, Mapping) or not any(
        str(k).startswith("model.student.") for k in checkpoint
    ):
        return checkpoint
    model = {k[len("model.") :]: v for k, v in checkpoint.items() if str(k).startswith("model.")}
    rest = {k: v for k, v in checkpoint.items() if not str(k).startswith(("model.", "optimizer."))}
    return rest | {"model": model}


def _meta_training_state(checkpoint: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The model state of a gathered DINOv2/DINOv3 training checkpoint (keys ``student.backbone.*``,
    ``student.dino_head.*``, ``teacher.*`` under ``model``); None for any other layout."""
    model = nest_meta_layout(checkpoint).get("model")
    if is_tensor_dict(model) and any(k.startswith("student.backbone.") for k in model):
        return model
    return None


def weights_from_checkpoint(checkpoint: Mapping[str, Any], label: str) -> InitWeights:
    """Sort a loaded checkpoint into :class:`InitWeights` (see the module docstring for the layouts)."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
    if not is_tensor_dict(state) and isinstance(checkpoint, Mapping):
        state = _meta_training_state(checkpoint)  # Meta's own training checkpoint, gathered
    norm = _recorded_norm_last_layer(checkpoint) if isinstance(checkpoint, Mapping) else None
    if is_tensor_dict(state) and any(k.startswith("student.backbone.") for k in state):  # ours (Lightning)
        # A distillation checkpoint (ssl_xcit.dino.distill) saves no teacher: its student EMA (dinov3) or its
        # student stands for it.
        stand_in = next(
            (s for s in ("teacher", "student_ema") if any(k.startswith(s + ".") for k in state)), "student"
        )
        sides = {
            side: _dino_heads_only(
                _wrapper_parts({k[len(side) + 1 :]: v for k, v in state.items() if k.startswith(side + ".")})
            )
            for side in ("student", stand_in)
        }
        centres = {k: v for k, v in state.items() if k in _CENTRES}
        return InitWeights(label, sides["student"], sides[stand_in], centres, norm)
    if all(is_tensor_dict(checkpoint.get(side)) for side in ("student", "teacher")):  # official DINO full
        loss = checkpoint.get("dino_loss")
        centres = {"dino_loss.center": loss["center"]} if is_tensor_dict(loss) and "center" in loss else {}
        student, teacher = (_wrapper_parts(checkpoint[side]) for side in ("student", "teacher"))
        return InitWeights(label, student, teacher, centres, norm)
    backbone, _ = extract_state_dict(checkpoint)  # one network (a teacher's, by preference) for both sides
    parts = _wrapper_parts(backbone)
    return InitWeights(label, dict(parts), dict(parts))


def timm_model(spec: str, option: str = "--model.init_from", **kwargs: Any) -> nn.Module:
    """``NAME`` or ``NAME@FILE`` (``timm:`` removed): timm's model NAME with its pretrained weights, from FILE
    when given (timm's ``pretrained_cfg_overlay``), else from timm's hub; ``kwargs`` go to
    ``timm.create_model``. ``option`` names the setting in the one-line errors."""
    import timm

    name, _, file = spec.partition("@")
    arch, _, tag = name.partition(".")
    label = f"{option} {TIMM_PREFIX}{spec}"
    if not timm.is_model(arch):
        close = difflib.get_close_matches(name, timm.list_pretrained(), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UserError(f"{label}: timm has no model {arch!r}{hint}")
    released = timm.list_pretrained(arch + ".*")
    if not released:  # timm would build it with random weights and a warning
        raise UserError(f"{label}: timm has no pretrained weights for {arch}")
    if tag and name not in released:
        raise UserError(
            f"{label}: timm has no weights {name!r}; its weights for {arch}: " + ", ".join(released)
        )
    if file and not Path(file).is_file():
        raise UserError(f"{label}: weights file not found: {file}")
    overlay = {"file": file} if file else None
    try:
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except RuntimeError as error:  # timm's strict load: the file holds another network
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{label}: the weights do not fit timm's {arch}: {first}") from error
    except TypeError:
        raise  # a keyword the model does not take: the caller's to handle
    except Exception as error:  # noqa: BLE001 - a download refused or impossible (no network, no hub access)
        raise UserError(
            f"{label}: timm could not fetch the weights ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); without a network, download "
            f"them elsewhere and pass timm:{name}@FILE"
        ) from error


def timm_weights(spec: str, option: str = "--model.init_from") -> InitWeights:
    """``NAME`` or ``NAME@FILE`` (``timm:`` removed): timm's NAME built headless (``num_classes=0``) with its
    pretrained weights (:func:`timm_model`)."""
    parts = {"backbone": timm_model(spec, option, num_classes=0).state_dict()}
    return InitWeights(TIMM_PREFIX + spec, parts, dict(parts))


def read_source(source: str, option: str = "--model.init_from") -> InitWeights:
    """The weights of SOURCE (a path or ``timm:NAME[@FILE]``); one-line ``UserError`` for a missing file.
    ``option`` names the setting in the errors."""
    if source.startswith(TIMM_PREFIX):
        return timm_weights(source[len(TIMM_PREFIX) :], option)
    return weights_from_checkpoint(read_source_file(source, option), source)


def read_source_file(source: str, option: str = "--model.init_from") -> Mapping[str, Any]:
    """The checkpoint in the file SOURCE; one-line ``UserError`` for a missing file."""
    if not is_checkpoint(source):
        raise UserError(
            f"{option} {source}: file not found (a .ckpt, .safetensors or .pth, a folder of FSDP2 shards, or "
            "timm:NAME[@FILE])"
        )
    if is_sharded_checkpoint(source):  # only the networks and loss centres: never the optimiser state
        return read_sharded_checkpoint(source, state_keys=_init_key, optimizer=False)
    return read_checkpoint(source)


def _init_key(key: str) -> bool:
    """A model key SOURCE's weights come from: a student, teacher or student-EMA tensor, or a loss centre."""
    return key.split(".", 1)[0] in ("student", "teacher", "student_ema") or key in _CENTRES


def _short(keys: list[str], n: int = 4) -> str:
    return "[" + ", ".join(keys[:n]) + (f", ... {len(keys)} in all" if len(keys) > n else "") + "]"


def _misfit(own: Mapping[str, Tensor], got: Mapping[str, Tensor], may_lack: tuple[str, ...] = ()) -> str:
    """'' when ``got`` fills ``own`` exactly (keys and shapes, ``may_lack`` aside), else what does not fit."""
    missing = sorted(k for k in set(own) - set(got) if k not in may_lack)
    unexpected = sorted(set(got) - set(own))
    shapes = [
        f"{k} {tuple(got[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(got))
        if got[k].shape != own[k].shape
    ]
    found = []
    if missing:
        found.append(f"missing {_short(missing)}")
    if unexpected:
        found.append(f"unexpected {_short(unexpected)}")
    if shapes:
        found.append(f"shapes (source vs model) {_short(shapes, 3)}")
    return "; ".join(found)


def _describe(hp: Mapping[str, Any]) -> str:
    kwargs = dict(hp.get("backbone_kwargs") or {})
    return hp["backbone"] + "".join(f" with {k}={v}" for k, v in sorted(kwargs.items()))


def fitted_backbone_state(
    raw: Mapping[str, Tensor], backbone: nn.Module, what: str, arch: str, label: str
) -> dict[str, Tensor]:
    """``raw`` (a backbone state in any naming :func:`convert_state_dict` reads) as ``backbone``'s state dict,
    every key and shape checked; otherwise a one-line ``UserError``: ``label`` (the setting and SOURCE) does
    not fit ``what`` (``arch``, its architecture), the keys that differ and, when recognised, what ``raw``
    holds."""
    state, _ = convert_state_dict(raw, backbone)  # official names -> ours; classifier heads dropped
    problem = _misfit(backbone.state_dict(), state, _MAY_BE_FRESH)
    if problem:
        found = infer_architecture(state)
        held = (found[0] + "".join(f" with {k}={v}" for k, v in sorted(found[1].items()))) if found else None
        hint = f"; it holds {held}: set --model.backbone (and backbone_kwargs) to match" if held else ""
        raise UserError(f"{label} does not fit the {what} {arch}: {problem}{hint}")
    return state


def source_backbone_state(
    source: str, backbone: nn.Module, hp: Mapping[str, Any], option: str, what: str
) -> dict[str, Tensor]:
    """The teacher backbone of SOURCE (anything ``--model.init_from`` reads: our .ckpt's teacher, an official
    full checkpoint's teacher, a backbone file, ``timm:NAME[@FILE]``) as a state dict that fits ``backbone``,
    built from the DINO hyperparameters ``hp``; ``option`` and ``what`` name the setting and the network in
    the one-line errors."""
    check_timm_architecture(source, hp["backbone"], option)
    weights = read_source(source, option)
    return fitted_backbone_state(
        weights.teacher["backbone"], backbone, what, _describe(hp), f"{option} {source}"
    )


def _backbone_state(weights: InitWeights, side: str, module: Any) -> dict[str, Tensor]:
    return fitted_backbone_state(
        getattr(weights, side)["backbone"],
        getattr(module, side).backbone,
        f"{side} backbone",
        _describe(module.hparams),
        f"--model.init_from {weights.label}",
    )


def _head_state(weights: InitWeights, side: str, part: str, module: Any) -> dict[str, Tensor] | None:
    """SOURCE's ``part`` of ``side`` checked against the model's, or None when either has none."""
    head: nn.Module | None = getattr(getattr(module, side), part, None)
    got = getattr(weights, side).get(part)
    if head is None or got is None:
        return None
    problem = _misfit(head.state_dict(), got)
    if problem:
        raise UserError(
            f"--model.init_from {weights.label}: its {side} {part.replace('_', ' ')} does not fit the model's "
            f"({problem}); set out_dim, head_hidden_dim, head_bottleneck_dim, head_nlayers and use_bn_in_head "
            "(and head_last_layer: weight_norm for DINO/DINOv2 heads, linear for DINOv3's) as in the run that "
            "wrote it, or start from its backbone alone (ssl-xcit export)"
        )
    return got


Plan = list[tuple[nn.Module, dict[str, Tensor]]]


def plan_weights(
    module: Any, weights: InitWeights
) -> tuple[Plan, list[tuple[Tensor, Tensor]], dict[str, bool]]:
    """Check that ``weights`` fit ``module`` (a DINO), reading no value: the (network part, its state) pairs
    and the (loss centre, value) pairs to copy, and which parts come from SOURCE (``head``, ``patch_head``,
    ``centres``)."""
    plan: Plan = []
    loaded = {"head": True, "patch_head": True}
    _check_norm_last_layer(module, weights)
    for side in ("student", "teacher"):
        network = getattr(module, side)
        plan.append((network.backbone, _backbone_state(weights, side, module)))
        for part in ("head", "patch_head"):
            state = _head_state(weights, side, part, module)
            if state is not None:
                plan.append((getattr(network, part), state))
            loaded[part] = loaded[part] and state is not None
    centres = []
    for key in _CENTRES:
        loss_name = key.split(".")[0]
        loss = getattr(module, loss_name, None)
        head_part = (
            "head" if loss_name == "dino_loss" or not hasattr(module.student, "patch_head") else "patch_head"
        )
        if loss is None or key not in weights.centres or not loaded[head_part]:
            continue
        if weights.centres[key].shape != loss.center.shape:
            raise UserError(
                f"--model.init_from {weights.label}: its {key} has shape {tuple(weights.centres[key].shape)}, "
                f"the model's {tuple(loss.center.shape)}"
            )
        centres.append((loss.center, weights.centres[key]))
    loaded["centres"] = bool(centres)
    return plan, centres, loaded


def apply_weights(module: Any, weights: InitWeights) -> dict[str, bool]:
    """Copy ``weights`` into ``module`` (a DINO) after checking everything fits; returns which parts came
    from SOURCE (``head``, ``patch_head``, ``centres``)."""
    plan, centres, loaded = plan_weights(module, weights)
    with torch.no_grad():
        for target, state in plan:
            load_whole_state(target, state, strict=False)  # checked above: only may-be-fresh keys are absent
        for centre, value in centres:
            centre.copy_(value)
    return loaded


class ShardedSource:
    """A sharded SOURCE (an ``fsdp2`` run's checkpoint folder) read straight into a sharded model: its
    checkpoint stands in the usual sorting (:func:`weights_from_checkpoint`, :func:`plan_weights`) as meta
    tensors, shapes and dtypes from the index, so nothing but ``meta.pt`` is read to check the fit; then one
    collective DCP read copies every planned tensor into its place, each rank reading only its own slices
    (``ssl_xcit.models.shard_reader.fill_from_dcp``). No rank ever holds a whole network."""

    def __init__(self, source: str) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.source = source
        self.metadata = read_index(source)
        self.checkpoint = read_meta(source)
        self.origin: dict[int, str] = {}  # id(meta tensor) -> its flat DCP key
        state: dict[str, Tensor] = {}
        for key, flat in model_keys(self.metadata).items():
            entry = self.metadata.state_dict_metadata[flat[0]]
            if _init_key(key) and len(flat) == 1 and isinstance(entry, TensorStorageMetadata):
                state[key] = torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
                self.origin[id(state[key])] = flat[0]
        self.checkpoint["state_dict"] = state

    def covers(self, plan: Plan, centres: list[tuple[Tensor, Tensor]]) -> bool:
        """Whether every planned value is a stored tensor as it is (no conversion computed a new one)."""
        values = [v for _, state in plan for v in state.values()] + [v for _, v in centres]
        return all(id(v) in self.origin for v in values)

    def fill(self, plan: Plan, centres: list[tuple[Tensor, Tensor]]) -> None:
        """Copy the planned tensors into the model (collective: every rank, the same plan)."""
        from ssl_xcit.models.shard_reader import fill_from_dcp  # imports DCP (seconds): only when used

        targets: dict[str, Tensor] = {}
        again: list[tuple[Tensor, Tensor]] = []  # a stored tensor wanted twice (init_from_ema): copied after
        pairs = [(target.state_dict(keep_vars=True), state) for target, state in plan]
        wanted = [(own[k], v) for own, state in pairs for k, v in state.items()] + centres
        for place, value in wanted:
            key = self.origin[id(value)]
            if key in targets:
                again.append((place, targets[key]))
            else:
                targets[key] = place
        fill_from_dcp(self.source, targets, self.metadata)
        with torch.no_grad():
            for place, first in again:
                place.copy_(first)


def _holds_shards(module: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _check_norm_last_layer(module: Any, weights: InitWeights) -> None:
    """A head with a learnt weight norm (norm_last_layer false) would stay frozen at its loaded norms in a
    model whose norm_last_layer is true: refused, naming the setting. The other way round loads exactly (a
    normed head's norms are 1) and the norms then train, as the model's setting asks."""
    has_head = any(part in weights.student or part in weights.teacher for part in ("head", "patch_head"))
    if has_head and weights.norm_last_layer is False and module.hparams.get("norm_last_layer", True):
        raise UserError(
            f"--model.init_from {weights.label}: its heads were trained with norm_last_layer false (a learnt "
            "weight norm), the model has norm_last_layer true, which would freeze it: set --model.norm_last_layer "
            "false to continue them, or start from its backbone alone (ssl-xcit export)"
        )


def check_init_settings(init_from: str | None, init_head_warmup_steps: int | None) -> None:
    """Refuse settings that cannot work, at construction (SOURCE itself is read when a fresh fit starts)."""
    if init_head_warmup_steps is not None and int(init_head_warmup_steps) < 0:
        raise UserError(
            f"init_head_warmup_steps must be >= 0 or null (automatic), got {init_head_warmup_steps}"
        )
    if init_from is not None and not str(init_from).strip():
        raise UserError("init_from must name a file or timm:NAME[@FILE], got an empty string")


def check_timm_architecture(source: str, backbone: str, option: str = "--model.init_from") -> None:
    """Before any download: ``timm:NAME`` must be the architecture of ``--model.backbone``."""
    if not source.startswith(TIMM_PREFIX):
        return
    arch = source[len(TIMM_PREFIX) :].partition("@")[0].partition(".")[0]
    try:
        held = resolve(arch).name
    except UserError:
        return  # not one of ours: timm_weights names the model, or the key check refuses it
    if held != resolve(backbone).name:
        raise UserError(
            f"{option} {source} holds a {held} backbone, but --model.backbone is {backbone}: "
            f"pass --model.backbone {held}"
        )


def start_from_source(module: Any) -> None:
    """``on_fit_start``: load ``init_from`` into a fresh run (not a resumed one, not twice) and decide the
    head-only warm-up."""
    source = module.hparams.get("init_from")
    if not source or module.init_state is not None or module.trainer.ckpt_path is not None:
        return
    check_timm_architecture(str(source), module.hparams.backbone)
    shards = ShardedSource(str(source)) if is_sharded_checkpoint(source) and _holds_shards(module) else None
    if shards is not None:
        weights = _from_ema(module, weights_from_checkpoint(shards.checkpoint, str(source)))
        plan, centres, loaded = plan_weights(module, weights)
        if shards.covers(plan, centres):  # the same answer on every rank: it reads only the index
            shards.fill(plan, centres)
        else:  # a layout whose conversion computes new tensors: read them whole
            shards = None
    if shards is None:
        loaded = apply_weights(module, _from_ema(module, read_source(str(source))))
    fresh = fresh_heads(module.student, loaded)
    wanted = module.hparams.get("init_head_warmup_steps")
    steps = (AUTO_HEAD_WARMUP_STEPS if fresh else 0) if wanted is None else int(wanted)
    module.init_state = {"source": str(source), "head_warmup_steps": steps}
    parts = ["backbones"] + [p.replace("_", " ") + "s" for p in ("head", "patch_head") if loaded[p]]
    parts += ["centres"] if loaded["centres"] else []
    rank_zero_info(
        f"init_from {source}: loaded {', '.join(parts)}"
        + (
            f"; the backbone waits {steps} steps while the fresh {' and '.join(fresh)} warm up"
            if steps
            else ""
        )
    )


def _from_ema(module: Any, weights: InitWeights) -> InitWeights:
    """With ``init_from_ema``, the student starts from the teacher too (DINOv3's ``resume_from_teacher_chkpt``)."""
    return replace(weights, student=weights.teacher) if module.hparams.get("init_from_ema") else weights


def fresh_heads(student: nn.Module, loaded: Mapping[str, bool]) -> list[str]:
    """The student's parts beside its backbone (DINO head, iBOT patch head, any other) that SOURCE did not
    fill: each starts random, and any one of them trained into the backbone from step 1 would move it."""
    return [name for name, _ in student.named_children() if name != "backbone" and not loaded.get(name)]


def head_warmup_steps(module: Any) -> int:
    """Optimiser steps during which the student's backbone gets no update (0 without ``init_from``)."""
    state = module.init_state
    return 0 if state is None else int(state["head_warmup_steps"])


def drop_backbone_gradients(student: nn.Module, step: int, warmup_steps: int) -> None:
    """During the head-only warm-up, drop the backbone's gradients (``grad=None``: the optimiser skips the
    tensors, weight decay included, so the backbone and, through the EMA, the teacher's stay exactly as
    loaded)."""
    if step >= warmup_steps:
        return
    for param in student.backbone.parameters():
        param.grad = None
