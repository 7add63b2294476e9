"""Parameter groups, optimisers and the gradient surgery of the reference DINO training step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ssl_xcit.errors import UserError
from ssl_xcit.parallel.fsdp import local_tensors, tensor_norms

OPTIMIZERS = ("adamw", "sgd", "lars")


# DINOv3's layer 0 (``dinov3/train/param_groups.py``, ``get_vit_lr_decay_rate``): what comes before the first
# block. Top-level parameter names of this project's backbones: the patch embedding (XCiT's convolutional stem
# included), position embeddings (XCiT's Fourier encoding, BiXT's ``fourier_pos_encode``) and learned tokens
# (CLS, DINOv3's registers, iBOT's mask token, BiXT's latents).
EMBEDDING_NAMES = (
    "patch_embed", "pos_embed", "cls_token", "reg_token", "storage_tokens", "mask_token", "latents",
    "fourier_pos_encode",
)  # fmt: skip
# Names that wrappers insert (torch.compile, checkpoint wrappers), stripped as DINOv3 strips them.
_WRAPPER_NAMES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _plain_name(name: str) -> str:
    for wrapper in _WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name


def layer_id(name: str, num_blocks: int) -> int:
    """DINOv3's layer id of backbone parameter ``name`` (``dinov3/train/param_groups.py``): 0 for the embeddings
    and learned tokens (:data:`EMBEDDING_NAMES`), ``i + 1`` for ``blocks.i``, ``num_blocks + 1`` for everything
    after the last block (the final norm; XCiT's class-attention and CaiT's token-only blocks)."""
    top, _, rest = _plain_name(name).partition(".")
    if top in EMBEDDING_NAMES:
        return 0
    if top == "blocks":
        return int(rest.split(".", 1)[0]) + 1
    return num_blocks + 1


def lr_multiplier(name: str, num_blocks: int, layer_decay: float, patch_embed_lr_mult: float) -> float:
    """A backbone parameter's lr multiplier as DINOv3's: ``layer_decay ** (num_blocks + 1 - layer_id)``, times
    ``patch_embed_lr_mult`` for the patch embedding (``dinov3/train/param_groups.py``)."""
    scale = layer_decay ** (num_blocks + 1 - layer_id(name, num_blocks))
    if _plain_name(name).split(".", 1)[0] == "patch_embed":
        scale *= patch_embed_lr_mult
    return scale


def _num_blocks(backbone: nn.Module, layer_decay: float) -> int:
    blocks = getattr(backbone, "blocks", None)
    if isinstance(blocks, nn.ModuleList | nn.Sequential):
        return len(blocks)
    if layer_decay != 1.0:
        family = getattr(backbone, "family", type(backbone).__name__)
        raise UserError(
            f"layerwise_decay={layer_decay} needs a backbone with a stack of blocks (xcit, vit, cait, bixt, "
            f"dinov3); {family} has none: use layerwise_decay 1.0"
        )
    return 0


def get_params_groups(
    model: nn.Module, layerwise_decay: float = 1.0, patch_embed_lr_mult: float = 1.0
) -> list[dict]:
    """Two groups: regularised (index 0) and not regularised (biases and every 1-D tensor: norms, XCiT's
    ``gamma`` layer scales). Frozen parameters are left out. Group 0 gets the weight-decay schedule.

    With ``layerwise_decay`` or ``patch_embed_lr_mult`` other than 1 (DINOv3's 0.98-0.99 and 0.2), each of the two
    splits further by the lr multiplier of :func:`lr_multiplier` for the parameters of ``model.backbone`` (the
    heads keep 1, as DINOv3's, whose heads have no blocks); each group then carries ``lr_scale`` (its lr is the
    schedule's times it) and ``regularized`` (whether it takes the weight-decay schedule)."""
    decayed = layerwise_decay != 1.0 or patch_embed_lr_mult != 1.0
    backbone = getattr(model, "backbone", None)
    num_blocks = _num_blocks(backbone, layerwise_decay) if decayed and backbone is not None else 0
    backbone_ids = {id(p) for p in backbone.parameters()} if decayed and backbone is not None else set()
    prefix = "backbone."
    groups: dict[tuple[bool, float], list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        regularized = not (name.endswith(".bias") or param.ndim <= 1)
        scale = 1.0
        if id(param) in backbone_ids:
            inner = _plain_name(name)
            inner = inner[len(prefix) :] if inner.startswith(prefix) else inner
            scale = lr_multiplier(inner, num_blocks, layerwise_decay, patch_embed_lr_mult)
        groups.setdefault((regularized, scale if decayed else 1.0), []).append(param)
    if not decayed:
        return [
            {"params": groups.get((True, 1.0), [])},
            {"params": groups.get((False, 1.0), []), "weight_decay": 0.0},
        ]
    # Regularised groups first, then by decreasing multiplier: a fixed order, so checkpoints map group to group.
    out = []
    for (regularized, scale), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], -kv[0][1])):
        group = {"params": params, "lr_scale": scale, "regularized": regularized}
        if not regularized:
            group["weight_decay"] = 0.0
        out.append(group)
    return out


def apply_schedules(optimizer: torch.optim.Optimizer, lr: float, weight_decay: float) -> None:
    """This step's lr (times each group's ``lr_scale``) on every group and weight decay on the regularised ones
    (group 0 of the two default groups)."""
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = lr * group.get("lr_scale", 1.0)
        if group.get("regularized", i == 0):
            group["weight_decay"] = weight_decay


class LARS(torch.optim.Optimizer):
    """LARS as used by DINO (from Barlow Twins): SGD with momentum whose update is rescaled per tensor by
    ``eta * ||w|| / ||update||``. 1-D tensors (biases, norms) get neither weight decay nor the adaptation."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.0,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        eta: float = 0.001,
    ) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if p.ndim != 1:
                    update = update.add(p, alpha=group["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(update)
                    one = torch.ones_like(param_norm)
                    trust = torch.where(
                        param_norm > 0.0,
                        torch.where(update_norm > 0, group["eta"] * param_norm / update_norm, one),
                        one,
                    )
                    update = update.mul(trust)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(group["momentum"]).add_(update)
                p.add_(mu, alpha=-group["lr"])
        return loss


# torch's own fused (single multi-tensor kernel) implementations; LARS is ours and has none.
FUSED_OPTIMIZERS = ("adamw", "sgd")


def _check_fused(name: str, params_groups: list[dict]) -> None:
    """Refuse ``fused=True`` now, naming the optimiser and the device, where torch would refuse it only at
    the first step (torch checks each parameter's device and dtype inside ``step``)."""
    if name not in FUSED_OPTIMIZERS:
        raise UserError(
            f"optimizer {name!r} has no fused implementation in torch; fused=True works with: "
            f"{', '.join(FUSED_OPTIMIZERS)}"
        )
    # The list torch itself checks against in `step` (private, but the only source of truth for it).
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    for group in params_groups:
        for param in group["params"]:
            if name == "sgd" and isinstance(param, DTensor):  # torch's step would fail on its first call
                raise UserError(
                    "torch has no fused sgd for sharded (--trainer.strategy fsdp2) parameters: aten._fused_sgd_ "
                    "has no DTensor rule; use --model.fused_optimizer false (fused adamw works)"
                )
            if param.device.type not in supported:
                raise UserError(
                    f"torch has no fused {name} for parameters on device {param.device.type!r} "
                    f"(torch {torch.__version__} supports: {', '.join(supported)}); use fused=False"
                )
            if not torch.is_floating_point(param):
                raise UserError(f"fused {name} needs floating-point parameters, got {param.dtype}")


def fused_by_default(name: str, params_groups: list[dict], loss_scaled: bool) -> bool:
    """``fused_optimizer``'s automatic choice: fused exactly when the loss is scaled (``16-mixed``) and torch
    has a fused kernel for the optimiser and the parameters' device. Under a GradScaler only a fused step takes
    ``found_inf`` on the device; a non-fused one reads it on the host every step (docs/training.md)."""
    if not loss_scaled or name.lower() not in FUSED_OPTIMIZERS:
        return False
    try:
        _check_fused(name.lower(), params_groups)
    except UserError:
        return False
    return True


def build_optimizer(name: str, params_groups: list[dict], fused: bool = False) -> torch.optim.Optimizer:
    """``adamw`` (default betas), ``sgd`` (momentum 0.9) or ``lars``. LR and weight decay start at 0 and are
    overwritten from the schedules before every step. ``fused=True`` uses torch's fused AdamW or SGD (one
    kernel for all parameters; the same update up to rounding) and is refused for LARS or for parameters on
    a device torch has no fused kernel for."""
    name = name.lower()
    if name not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    if fused:
        _check_fused(name, params_groups)
    # fused=None (not False) leaves torch's own default choice of implementation untouched.
    if name == "adamw":
        optimizer = torch.optim.AdamW(params_groups, lr=0.0, fused=True if fused else None)
    elif name == "sgd":
        optimizer = torch.optim.SGD(params_groups, lr=0.0, momentum=0.9, fused=True if fused else None)
        if fused:
            optimizer.register_step_pre_hook(_late_momentum_buffers)
    else:
        return LARS(params_groups)
    # Public since torch 2.1 (pytorch#105953); pyproject.toml promises torch>=2.6.
    optimizer.register_load_state_dict_pre_hook(_keep_live_implementation)
    return optimizer


# The keys of a torch optimiser's param groups that choose how its step runs, not what it computes.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
# Keys of our own that the live options decide (get_params_groups): a checkpoint keeps its lr and weight decay,
# never these (torch restores the saved groups whole).
GROUP_KEYS = ("lr_scale", "regularized")


def _keep_live_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``load_state_dict`` pre-hook: the param groups keep this run's implementation flags, not the checkpoint's.

    torch restores the saved groups whole, so a checkpoint of a non-fused optimiser (``32-true`` or
    ``bf16-mixed``, where ``fused_optimizer: null`` builds a non-fused one) resumed under a GradScaler made the
    live fused optimiser run its non-fused step, while the instance still told the scaler it takes
    ``found_inf`` (``_step_supports_amp_scaling``): "Expected grad_scale and found_inf to be None" at the first
    step. The reverse ran a fused step where this run chose none (and the fused SGD without its momentum hook).
    A pre-hook and not a post-hook: torch places each state's ``step`` by the groups it loads (on the parameter's
    device, in float32, for fused or capturable groups). A fused or capturable checkpoint's ``step`` returns to
    the host where this run's groups are neither, as torch makes it for them (no device read per step)."""
    saved = state_dict["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        return state_dict  # torch's own error for the mismatch
    groups, host_step = [], set()
    for live, group in zip(optimizer.param_groups, saved, strict=True):
        flags = {key: live[key] for key in IMPLEMENTATION_KEYS + GROUP_KEYS if key in live}
        groups.append({**group, **flags})
        if not (flags.get("fused") or flags.get("capturable")):
            host_step.update(group["params"])
    state = {}
    for param_id, param_state in state_dict["state"].items():
        step = param_state.get("step") if isinstance(param_state, dict) else None
        if param_id in host_step and isinstance(step, torch.Tensor) and step.device.type != "cpu":
            param_state = {**param_state, "step": step.to("cpu")}
        state[param_id] = param_state
    # New containers: the caller's state dict (a checkpoint Lightning may still hold) is left as it was.
    return {**state_dict, "param_groups": groups, "state": state}


def _late_momentum_buffers(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Zero momentum buffers, before the step, for the parameters with a gradient and none yet. torch's fused
    SGD makes them itself only when no parameter has one, and refuses a mix (the backbone after ``init_from``'s
    head warm-up, the last layer after its freeze); and it makes them with ``empty_like``, which a first step
    skipped on a GradScaler overflow leaves uninitialised for every later step. With a zero buffer this step's
    buffer is the gradient, as the default SGD's first step makes it, and a skipped step leaves zeros."""
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for param in group["params"]:
            if param.grad is not None and optimizer.state.get(param, {}).get("momentum_buffer") is None:
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)


CLIP_MODES = ("per_parameter", "per_module")


@torch.no_grad()
def clip_gradients(model: nn.Module, clip: float) -> torch.Tensor:
    """Per-parameter clipping of the reference: each gradient whose L2 norm exceeds ``clip`` is rescaled to
    norm ``clip`` (not a global-norm clip). Returns the norms before clipping.

    Vectorised with ``torch._foreach_*`` and a ``min(1, coef)`` factor instead of the reference's Python
    ``if`` per tensor: identical values (multiplying by 1.0 is exact) without a device sync per parameter.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(0)
    norms = tensor_norms(grads)  # whole-tensor norms of sharded (FSDP2) gradients too
    coefs = (clip / (norms + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(list(local_tensors(grads)), list(coefs.unbind()))
    return norms


@torch.no_grad()
def clip_total_norm(module: nn.Module, clip: float) -> torch.Tensor | None:
    """``torch.nn.utils.clip_grad_norm_(module.parameters(), clip)``: all of ``module``'s gradients scaled by
    ``min(1, clip / (total + 1e-6))``, ``total`` the L2 norm of their concatenation. Under FSDP2 ``total`` is the
    whole gradients' norm (each tensor's local squared norm summed over the mesh, :func:`tensor_norms`), the same
    on every rank. Returns ``total`` (None without gradients). No host read."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    total = tensor_norms(grads).float().square().sum().sqrt()
    coef = (clip / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(list(local_tensors(grads)), coef.to(grads[0].dtype))
    return total


def clip_per_module(model: nn.Module, clip: float) -> dict[str, torch.Tensor]:
    """DINOv3's clip (``dinov3/train/train.py``): ``clip_grad_norm_`` on each of the student's submodules in turn
    (backbone, DINO head, iBOT head), each with its own total norm. Returns each one's norm before clipping."""
    norms = {}
    for name, child in model.named_children():
        total = clip_total_norm(child, clip)
        if total is not None:
            norms[name] = total
    return norms


def check_clip_mode(mode: str) -> None:
    if mode not in CLIP_MODES:
        raise UserError(f"clip_mode must be one of {', '.join(CLIP_MODES)}, got {mode!r}")


def cancel_gradients_last_layer(epoch: int, model: nn.Module, freeze_last_layer: int) -> None:
    """Drop the gradients of the head's last layer during the first ``freeze_last_layer`` epochs. ``grad=None``
    (not zero) so that AdamW skips the tensor entirely, weight decay included, as in the reference."""
    if epoch >= freeze_last_layer:
        return
    for name, param in model.named_parameters():
        if "last_layer" in name:
            param.grad = None


# The families whose backbones have a stack of ``blocks`` that layer-wise lr decay counts.
LAYER_DECAY_FAMILIES = ("xcit", "vit", "cait", "bixt", "dinov3")
# DINO's optimisation (main_dino.py) and DINOv3's distillation's (the ``optim:`` section of
# dinov3/configs/train/dinov3_vitl16_lvd1689m_distilled.yaml: clip_grad 3.0 through train.py's per-submodule
# clip_grad_norm_, layerwise_decay 0.99, patch_embed_lr_mult 0.2, scaling_rule sqrt_wrt_1024).
DINO_OPTIMISATION = dict(
    clip_mode="per_parameter", layerwise_decay=1.0, patch_embed_lr_mult=1.0, lr_scaling_rule="linear_wrt_256"
)
DINOV3_DISTILL_OPTIMISATION = dict(
    clip_mode="per_module", layerwise_decay=0.99, patch_embed_lr_mult=0.2, lr_scaling_rule="sqrt_wrt_1024"
)


def objective_optimisation(dinov3: bool, backbone: str, **given: Any) -> dict[str, Any]:
    """``given`` (``clip_mode``, ``layerwise_decay``, ``patch_embed_lr_mult``, ``lr_scaling_rule``) with each None
    replaced by the objective's reference: DINOv3's distillation values under ``dinov3``, DINO's otherwise. A
    backbone without blocks (ConvNeXt, CrossFormer++) gets no layer-wise decay by default, as DINOv3's rule gives
    it (``param_groups.py``: no ``blocks``, so every multiplier is 1)."""
    from ssl_xcit.models.registry import family_of

    reference = DINOV3_DISTILL_OPTIMISATION if dinov3 else DINO_OPTIMISATION
    out = {key: reference[key] if value is None else value for key, value in given.items()}
    if given.get("layerwise_decay") is None and family_of(backbone) not in LAYER_DECAY_FAMILIES:
        out["layerwise_decay"] = 1.0
    return out
