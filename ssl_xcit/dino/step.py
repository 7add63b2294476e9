"""DINO's step math and what it logs: the forwards, the DINO, KoLeo, iBOT and Gram losses and their total.

:func:`compute_losses` needs no Trainer: ``DINO.training_step`` and ``DINO.validation_step`` both call it (so
``val/loss`` and ``train/loss`` are the same quantity), and the fake-CUDA tests (``tests/gpu``) run it as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from lightning.pytorch import LightningModule

from ssl_xcit.dino.gram import check_gram_crops, gram_term
from ssl_xcit.dino.head import LAST_LAYERS
from ssl_xcit.dino.ibot import MaskedPatches, masked_forward
from ssl_xcit.dino.koleo import grouped_koleo_loss, koleo_loss
from ssl_xcit.dino.loss import DINOLossOutput
from ssl_xcit.dino.optim import check_clip_mode
from ssl_xcit.dino.schedules import LR_SCALING_RULES
from ssl_xcit.errors import UserError
from ssl_xcit.utils.transfer import scalars_to_device

NUM_GLOBAL_CROPS = 2


def check_settings(hp: Mapping[str, Any]) -> None:
    """A UserError naming the first of DINO's settings (``hp``, its hyperparameters) that is out of range."""
    if hp["sync_every_n_steps"] < 1:
        raise UserError(f"sync_every_n_steps must be >= 1, got {hp['sync_every_n_steps']}")
    if hp["accumulate_grad_batches"] < 1:
        raise UserError(f"accumulate_grad_batches must be >= 1, got {hp['accumulate_grad_batches']}")
    if hp["teacher_temp"] <= 0 or hp["warmup_teacher_temp"] <= 0 or hp["student_temp"] <= 0:
        raise UserError("temperatures must be > 0")
    if not hp["koleo_weight"] >= 0:
        raise UserError(f"koleo_weight must be >= 0 (0 disables KoLeo), got {hp['koleo_weight']!r}")
    group = hp.get("koleo_group_size")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 2):
        raise UserError(
            f"koleo_group_size must be an integer >= 2 (images of the global batch per KoLeo group; DINOv3's "
            f"high-resolution stage: 16) or null (each rank's batch), got {group!r}"
        )
    if not hp["ibot_loss_weight"] >= 0:
        raise UserError(f"ibot_loss_weight must be >= 0 (0 disables iBOT), got {hp['ibot_loss_weight']!r}")
    if not hp.get("ibot_weight_warmup_epochs", 0.0) >= 0:
        raise UserError(f"ibot_weight_warmup_epochs must be >= 0, got {hp['ibot_weight_warmup_epochs']!r}")
    if hp.get("ibot_bn_stats", "all") not in ("all", "unmasked"):
        raise UserError(f"ibot_bn_stats must be 'all' or 'unmasked', got {hp['ibot_bn_stats']!r}")
    if hp.get("head_last_layer", "weight_norm") not in LAST_LAYERS:
        raise UserError(
            f"head_last_layer must be one of {', '.join(LAST_LAYERS)}, got {hp['head_last_layer']!r}"
        )
    check_optimisation_settings(hp)
    out_dim, ibot_out_dim = hp["out_dim"], hp["ibot_out_dim"]
    if hp["ibot_loss_weight"] > 0 and not hp["ibot_separate_head"] and ibot_out_dim not in (None, out_dim):
        raise UserError(
            f"a shared head has out_dim={out_dim} prototypes, got ibot_out_dim={ibot_out_dim}; "
            "drop ibot_out_dim or set ibot_separate_head: true"
        )


def check_optimisation_settings(hp: Mapping[str, Any]) -> None:
    """A UserError naming the first of the DINOv3 optimisation options (``clip_mode``, ``layerwise_decay``,
    ``patch_embed_lr_mult``, ``lr_scaling_rule``, ``final_momentum_teacher``, ``local_crops_weight``,
    ``teacher_mode``) that is out of range."""
    check_clip_mode(hp.get("clip_mode", "per_parameter"))
    if not 0 < hp.get("layerwise_decay", 1.0) <= 1:
        raise UserError(f"layerwise_decay must be in (0, 1] (1 = off), got {hp['layerwise_decay']!r}")
    if not hp.get("patch_embed_lr_mult", 1.0) >= 0:
        raise UserError(f"patch_embed_lr_mult must be >= 0 (1 = off), got {hp['patch_embed_lr_mult']!r}")
    rule = hp.get("lr_scaling_rule", "linear_wrt_256")
    if rule not in LR_SCALING_RULES:
        raise UserError(f"lr_scaling_rule must be one of {', '.join(LR_SCALING_RULES)}, got {rule!r}")
    if not 0 <= hp.get("final_momentum_teacher", 1.0) <= 1:
        raise UserError(f"final_momentum_teacher must be in [0, 1], got {hp['final_momentum_teacher']!r}")
    if not hp.get("local_crops_weight", 1.0) >= 0:
        raise UserError(f"local_crops_weight must be >= 0 (1 = off), got {hp['local_crops_weight']!r}")
    if hp.get("teacher_mode", "train") not in ("train", "eval"):
        raise UserError(f"teacher_mode must be 'train' or 'eval', got {hp['teacher_mode']!r}")


class StepLosses(NamedTuple):
    """One step's losses: ``total`` = DINO + koleo_weight x KoLeo + ibot_loss_weight x iBOT (device tensors)."""

    total: torch.Tensor
    dino: DINOLossOutput | None  # None for an objective without a teacher distribution (feature distillation)
    koleo: torch.Tensor | None  # None when KoLeo is off
    ibot: DINOLossOutput | None  # None when iBOT is off
    batch_size: int
    terms: Mapping[str, torch.Tensor] | None = None  # further named terms, logged as <stage>/<name>
    gram: torch.Tensor | None = None  # None when Gram anchoring is off at this step


def compute_losses(
    model: Any,
    crops: list[torch.Tensor],
    masks: MaskedPatches | None,
    epoch: int,
    update_center: bool,
    gram_crops: list[torch.Tensor] | None = None,
) -> StepLosses:
    """One step's math, needing no Trainer: teacher (no grad) and student forwards, the DINO, KoLeo,
    iBOT and Gram losses and their total. ``masks``: iBOT's (None when off); ``update_center``: move the EMA
    centres (training) or not (validation); ``gram_crops``: the Gram teacher's crops of the batch, which a
    model that anchors needs (``ssl_xcit.dino.gram.check_gram_crops``)."""
    batch_size = crops[0].shape[0]
    check_gram_crops(model, crops, gram_crops)
    gram_on = getattr(model, "gram_weight_now", 0.0) > 0  # a host float of this step (ssl_xcit.dino.gram)
    student_patches = None
    if masks is not None:
        fw = masked_forward(
            model.student,
            model.teacher,
            crops,
            masks,
            NUM_GLOBAL_CROPS,
            bn_from_unmasked=model.hparams.get("ibot_bn_stats", "all") == "unmasked",
        )
        teacher_output, student_output, embedding = fw.teacher_output, fw.student_output, fw.student_embedding
        student_patches = fw.student_patch_tokens if gram_on else None
    else:
        with torch.no_grad():
            teacher_output = model.teacher(crops[:NUM_GLOBAL_CROPS])
        if gram_on:
            student_output, embedding, student_patches = model.student.forward_with_patches(
                crops, None, n_global=NUM_GLOBAL_CROPS
            )
        else:
            student_output, embedding = model.student(crops, return_embeddings=True)
    dino = model.dino_loss(
        student_output,
        teacher_output,
        epoch,
        update_center=update_center,
        # local_crops_weight's value of this step, a host float (ssl_xcit.dino.schedules.local_weight_ramp)
        local_weight=getattr(model, "local_weight_now", 1.0),
    )
    total, koleo, patch = dino.loss, None, None
    group = model.hparams.get("koleo_group_size")
    if model.hparams.koleo_weight > 0 and group is not None:
        # DINOv3's distributed KoLeo: per global crop, over groups of the global batch. Every rank calls it
        # whatever its batch (it agrees the batch sizes with the others, and may gather).
        views = embedding[: NUM_GLOBAL_CROPS * batch_size].chunk(NUM_GLOBAL_CROPS)
        koleo = sum(grouped_koleo_loss(view, group) for view in views)
        total = total + model.hparams.koleo_weight * koleo
    elif model.hparams.koleo_weight > 0:
        # Per global crop and per rank, as in DINOv2: each view's local batch is spread on its own. A rank
        # left with one readable image has no neighbour to push from: its term is 0 (no collective is
        # involved, so the other ranks are unaffected and nobody waits).
        if batch_size >= 2:
            views = embedding[: NUM_GLOBAL_CROPS * batch_size].chunk(NUM_GLOBAL_CROPS)
            koleo = sum(koleo_loss(view) for view in views)
        else:
            koleo = embedding.new_zeros((), dtype=torch.float32)
        total = total + model.hparams.koleo_weight * koleo
    if masks is not None:
        patch = model.ibot_loss(
            fw.student_patch_logits, fw.teacher_patch_logits, masks, epoch, update_center=update_center
        )
        # The weight of this step (ibot_weight_warmup_epochs ramps it up), a host float: no device read.
        total = total + model.ibot_weight_now * patch.loss
    gram = gram_term(model, gram_crops, student_patches, tuple(crops[0].shape[-2:]))
    if gram is not None:
        total = total + model.gram_weight_now * gram
    return StepLosses(total, dino, koleo, patch, batch_size, gram=gram)


def log_losses(module: LightningModule, stage: str, out: StepLosses) -> None:
    """The step's losses and collapse signals: device tensors, which Lightning reads when it writes. The
    training loss stays off Lightning's progress bar, whose values Lightning reads on every batch; DINO's bar
    (``ssl_xcit.trainer.progress``) shows the value read every ``sync_every_n_steps`` steps instead."""
    train = stage == "train"
    kw = dict(on_step=train, on_epoch=not train, sync_dist=not train, batch_size=out.batch_size)
    module.log(f"{stage}/loss", out.total.detach(), prog_bar=not train, **{**kw, "on_epoch": True})
    if out.dino is not None:
        module.log(f"{stage}/teacher_entropy", out.dino.teacher_entropy, **kw)
        module.log(f"{stage}/kl_to_uniform", out.dino.kl_to_uniform, **kw)
    for name, value in (out.terms or {}).items():
        module.log(f"{stage}/{name}", value.detach(), **kw)
    if out.koleo is not None:
        module.log(f"{stage}/koleo", out.koleo.detach(), **kw)
    if out.ibot is not None:
        module.log(f"{stage}/ibot_loss", out.ibot.loss.detach(), **kw)
        module.log(f"{stage}/ibot_teacher_entropy", out.ibot.teacher_entropy, **kw)
        module.log(f"{stage}/ibot_kl_to_uniform", out.ibot.kl_to_uniform, **kw)
    if out.gram is not None:
        module.log(f"{stage}/gram_loss", out.gram.detach(), **kw)


def log_host_scalars(module: LightningModule, lr: float, wd: float, momentum: float) -> None:
    """The host's numbers of this step (schedules, skipped batches) in one non-blocking copy: ``self.log`` of
    a Python float copies each one to the device, blocking."""
    values = {
        "train/lr": lr,
        "train/wd": wd,
        "train/teacher_momentum": momentum,
        "train/teacher_temp": module.dino_loss.teacher_temp_at(module.current_epoch),
        "train/skipped_batches": module.skipped_batches,
    }
    for name, value in scalars_to_device(values, module.device).items():
        module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
