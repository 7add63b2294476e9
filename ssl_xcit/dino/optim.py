"""Parameter groups, optimisers and the gradient surgery of the reference DINO training step."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ssl_xcit.errors import UserError
from ssl_xcit.trainer.fsdp import local_tensors, tensor_norms

OPTIMIZERS = ("adamw", "sgd", "lars")


def get_params_groups(model: nn.Module) -> list[dict]:
    """Two groups: regularised (index 0) and not regularised (biases and every 1-D tensor: norms, XCiT's
    ``gamma`` layer scales). Frozen parameters are left out. Group 0 gets the weight-decay schedule."""
    regularized, not_regularized = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or param.ndim <= 1:
            not_regularized.append(param)
        else:
            regularized.append(param)
    return [{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}]


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
        flags = {key: live[key] for key in IMPLEMENTATION_KEYS if key in live}
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


def cancel_gradients_last_layer(epoch: int, model: nn.Module, freeze_last_layer: int) -> None:
    """Drop the gradients of the head's last layer during the first ``freeze_last_layer`` epochs. ``grad=None``
    (not zero) so that AdamW skips the tensor entirely, weight decay included, as in the reference."""
    if epoch >= freeze_last_layer:
        return
    for name, param in model.named_parameters():
        if "last_layer" in name:
            param.grad = None
