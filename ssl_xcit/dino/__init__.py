"""DINO self-distillation for XCiT: head, loss, schedules, optimisation, the LightningModule.

The objective lives here (masked_bn, multicrop, optim, optimizer_step and precision included, as DINO's math),
with the module's lifecycle hooks (``lifecycle``) and the collapse guard that reads its teacher (``collapse``).
It builds on ssl_xcit.parallel (sharding, meta start, synced BatchNorm, step checks, checkpoint IO) and never
imports ssl_xcit.trainer, the run around the step (callbacks, pre-emption, progress), which imports it.

>>> from ssl_xcit.dino import DINO
>>> model = DINO("xcit_nano_12_p16", out_dim=4096)
"""

from ssl_xcit.dino.head import DINOHead, WeightNormLinear
from ssl_xcit.dino.loss import DINOLoss, DINOLossOutput
from ssl_xcit.dino.optim import (
    LARS,
    build_optimizer,
    cancel_gradients_last_layer,
    clip_gradients,
    get_params_groups,
)
from ssl_xcit.dino.schedules import cosine_schedule, scaled_lr, teacher_temperature

__all__ = [
    "DINO",
    "DINOHead",
    "DINOLoss",
    "DINOLossOutput",
    "LARS",
    "WeightNormLinear",
    "build_optimizer",
    "cancel_gradients_last_layer",
    "clip_gradients",
    "cosine_schedule",
    "get_params_groups",
    "scaled_lr",
    "teacher_temperature",
]


def __getattr__(name: str):
    # The LightningModule imports Lightning; load it only when asked for.
    if name == "DINO":
        from ssl_xcit.dino.module import DINO

        return DINO
    raise AttributeError(name)
