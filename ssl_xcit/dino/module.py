"""DINO as a LightningModule: student/teacher backbones + DINOHead, the DINO loss, and the reference training step.

One training step, top to bottom (``main_dino.py:train_one_epoch``):

1. set lr (all groups, times each group's multiplier) and weight decay (the regularised groups) from the
   per-iteration schedules at ``global_step``;
2. teacher forward on the 2 global crops (no grad; train mode as the reference, eval under ``teacher_mode``),
   student forward on all crops, batched by resolution (one backbone pass per crop size), DINO loss (+ centre
   update; ``local_crops_weight`` on its local pairs), plus ``koleo_weight`` x DINOv2's KoLeo term on the
   student's global-crop embeddings when that weight is > 0, plus ``ibot_loss_weight`` x iBOT's masked patch
   term when that weight is > 0 (half of the student's global crops get block masks; the teacher sees them
   unmasked; ``ssl_xcit.dino.ibot``). ``compute_losses`` is this step's math, shared with ``validation_step``;
3. record on the device whether the loss is finite (read every ``sync_every_n_steps`` steps:
   ``ssl_xcit.parallel.step_checks``);
4. backward; gradient clipping (per parameter, or per submodule: ``clip_mode``); last-layer gradients dropped while epoch < freeze_last_layer;
   optimiser step;
5. EMA of the student's parameters into the teacher with the per-iteration momentum.

Manual optimisation, on purpose: the reference's order (clip -> cancel last layer -> step -> EMA with the
momentum of *this* iteration) is explicit in ``training_step`` instead of being spread over hooks, the EMA
runs once per real optimiser step, and ``global_step`` counts exactly those steps. The window's end (gradient
reduction, clip in true gradient units under fp16's scaler, step, EMA) is ``ssl_xcit.dino.optimizer_step``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ssl_xcit.data.datasets import EmptyBatch
from ssl_xcit.dino.gram import build_gram_teacher, gram_crops_from_batch, gram_weight
from ssl_xcit.dino.ibot import MaskedPatches, MaskSampler
from ssl_xcit.dino.ibot_loss import iBOTPatchLoss
from ssl_xcit.dino.init_from import check_init_settings
from ssl_xcit.dino.lifecycle import DINOLifecycle
from ssl_xcit.dino.loss import DINOLoss, TeacherTargets
from ssl_xcit.dino.multicrop import buffers_preserved, crops_from_batch, student_and_teacher
from ssl_xcit.dino.optim import apply_schedules
from ssl_xcit.dino.optimizer_step import before_optimizer_step, ema_update, gradient_sync, window_step
from ssl_xcit.dino.schedules import Schedules, local_weight_ramp
from ssl_xcit.dino.step import (
    NUM_GLOBAL_CROPS,
    StepLosses,
    check_settings,
    compute_losses,
    log_host_scalars,
    log_losses,
)
from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model
from ssl_xcit.models.activation_checkpointing import enable_activation_checkpointing
from ssl_xcit.parallel.meta_start import meta_device_if, recorded_construction
from ssl_xcit.parallel.step_checks import FiniteWatch, HostAgreement


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


class DINO(DINOLifecycle):
    """Self-distillation with no labels (DINO, Caron et al. 2021) for any registered backbone.

    Defaults are the reference ``main_dino.py`` defaults (see ``recipes/`` for the published XCiT runs).

    Args:
        backbone: registered model name (``ssl_xcit.models.list_models()``), e.g. ``xcit_small_12_p16``.
        drop_path_rate: stochastic depth of the *student* only; the teacher is an average and gets none.
        backbone_kwargs: extra ``create_model`` overrides (e.g. ``{"depth": 4}`` for a tiny test model).
        out_dim: prototypes K. 65536 for ImageNet; small datasets collapse less with a few thousand.
        norm_last_layer: freeze the last layer's weight norm at 1 (stable; False is a little better for
            XCiT-S/ViT-S but can be unstable).
        head_last_layer: the heads' last layer: ``weight_norm`` (DINO's and DINOv2's weight-normalised layer,
            whose norm ``norm_last_layer`` may freeze) or ``linear`` (DINOv3's plain trainable layer,
            dinov3/layers/dino_head.py; ``norm_last_layer`` does not apply to it).
        use_bn_in_head: BatchNorm in the head MLP (off in the reference ViT/XCiT runs).
        head_hidden_dim, head_bottleneck_dim, head_nlayers: head shape (2048, 256, 3 in every DINO run).
        warmup_teacher_temp: teacher temperature at epoch 0. Lower sharpens more (0.02 fights collapse on
            small data, per the DINO authors).
        teacher_temp: teacher temperature after warm-up; > 0.07 is unstable.
        warmup_teacher_temp_epochs: epochs of the linear teacher-temperature warm-up (30 in the paper).
        student_temp: 0.1 in every published run.
        center_momentum: EMA of the centre; 0.9.
        centering: ``ema`` (DINO's centre) or ``sinkhorn_knopp`` (DINOv2's equipartition of the teacher
            targets over the batch; keeps small batches on small data out of both collapse modes).
        momentum_teacher: EMA momentum at step 0, raised to 1 on a cosine. 0.996 for batch 1024; the authors
            advise 0.9995 for batch 256, and small datasets train faster with ~0.99.
        lr: peak learning rate for a total batch of 256 (linearly scaled by ``scale_lr_with_batch``).
        min_lr: end of the cosine LR schedule.
        warmup_epochs: linear LR warm-up from 0 (10 in the reference).
        weight_decay, weight_decay_end: cosine weight-decay schedule 0.04 -> 0.4 on weights only.
        clip_grad: gradient-norm clip (0 disables; per parameter or per submodule: ``clip_mode``); 3.0 in the
            reference.
        freeze_last_layer: epochs during which the head's last layer is not updated; stabilises the start.
        optimizer: ``adamw`` (reference default for transformers), ``sgd`` or ``lars`` (for ResNets).
        fused_optimizer: torch's fused AdamW/SGD kernel (one launch for all parameters). None (default): fused
            under ``16-mixed``'s GradScaler where torch has the kernel (no host read per step), else torch's
            default (docs/training.md); True refuses LARS or a device without fused kernels.
        scale_lr_with_batch: lr x total batch / 256 with total = per-device batch x devices x nodes x
            ``accumulate_grad_batches``, as in the reference.
        accumulate_grad_batches: batches per optimiser step. Manual optimisation does its own accumulation
            (Lightning's Trainer flag does not apply to it); leave the Trainer's at 1.
        sync_batchnorm: convert XCiT's BatchNorms (patch embedding, LPI) to synchronised BN under DDP, as
            the reference does (``AllReduceBatchNorm``); leave ``Trainer(sync_batchnorm=...)`` off (torch's
            SyncBatchNorm cannot run on CPU/gloo, and reads the host in every forward on CUDA).
        compile: ``torch.compile`` the two backbones (in place: checkpoint keys unchanged).
        activation_checkpointing: recompute each student block's activations in the backward instead of keeping
            them (``ssl_xcit.models.activation_checkpointing``): memory for compute, docs/benchmarks.md.
        collapse_guard: ``warn`` once, or ``stop`` the run, when the teacher holds a collapse mode for
            ``collapse_patience`` steps after the first ``collapse_grace_steps`` (``ssl_xcit.dino.collapse``);
            ``off`` disables it.
        koleo_weight: weight of DINOv2's KoLeo regulariser on the student's global-crop embeddings (0 = off,
            as in DINO; DINOv2 uses 0.1). It spreads the batch apart, which small data needs to escape the
            uniform collapse (``ssl_xcit.dino.koleo``).
        koleo_group_size: None (default): KoLeo spreads each rank's batch on its own (DINOv2); N: over groups of N
            consecutive images of the global batch, gathered across ranks when a group spans them (DINOv3's
            ``koleo_loss_distributed`` with ``koleo_distributed_loss_group_size``; 16 in its high-resolution stage).
        ibot_loss_weight: weight of iBOT's masked patch distillation (0 = off, as in DINO; DINOv2 uses 1.0).
            It trains the patch tokens that VLAD/ASMK retrieve with; XCiT, ViT and CaiT only (docs/ibot.md).
        ibot_separate_head: a patch head of its own (DINOv2) or the DINO head shared (iBOT).
        ibot_out_dim: prototypes of the patch head (None: ``out_dim``, as DINOv2's 65536 for both).
        ibot_warmup_teacher_temp, ibot_teacher_temp, ibot_warmup_teacher_temp_epochs: the patch term's own
            teacher temperature schedule (None: the DINO term's value, as in DINOv2).
        ibot_weight_warmup_epochs: epochs over which the patch term's weight rises linearly from 0 to
            ``ibot_loss_weight`` (0: the full weight from the first step, as in DINOv2). Measured in docs/ibot.md.
        ibot_bn_stats: ``all``: BatchNorm layers (XCiT's stem and LPI) of the student's masked pass normalise with
            the statistics of all its global crops, blanks included; ``unmasked``: with those of the crops without
            masked patches (``ssl_xcit.dino.masked_bn``; one process only). Measured in docs/ibot.md.
        mask_ratio_min_max: masked fraction of a masked global crop, uniform in this range (DINOv2: 0.1-0.5).
        mask_probability: share of the global crops that are masked (DINOv2: 0.5).
        gram_loss_weight: weight of DINOv3's Gram anchoring (``ssl_xcit.dino.gram``; 0 = off, the default until it
            is measured here: docs/ibot.md). It holds the student's patch-to-patch cosine similarities on its
            global crops to those of a frozen Gram teacher; DINOv3's 7B run used 2.0 late in training, where its
            dense quality had started to fall. XCiT, ViT and CaiT only.
        gram_start_step: the optimiser step from which the term counts; the EMA teacher of that step becomes the
            Gram teacher (DINOv3: 1M of 1.2M iterations, once dense quality peaked). 0 would anchor to the
            untrained initialisation: set it where dense quality is still good.
        gram_weight_warmup_steps: steps over which the term's weight rises from 0 at ``gram_start_step`` to
            ``gram_loss_weight`` along DINOv3's half cosine (``schedules.gram_ramp``). DINOv3's 7B run ramps to
            2.0 over 1k iterations, to spare a student that has trained 1M iterations without the term a sudden
            new gradient; its high-resolution adaptation starts at its constant 1.5. 0 (default): the full
            weight at once; a snapshot of the run's own EMA teacher is close to the student, so the term starts
            small anyway (a fixed ``gram_teacher`` from elsewhere is where a ramp matters).
        gram_refresh_every: the Gram teacher is replaced by the EMA teacher before each step after
            ``gram_start_step`` that is a multiple of this (DINOv3's ``(it + 1) % freq`` rule; 0 = never, the
            default, as DINOv3's high-resolution adaptation; its 7B run refreshed every 10k iterations).
        gram_max_refreshes: at most this many replacements (3, as DINOv3's 7B run).
        gram_teacher: a fixed Gram teacher, used from ``gram_start_step``: any SOURCE ``init_from`` reads (its
            teacher backbone), read when a fresh fit starts and then carried by the run's checkpoints; ``init_from``
            for init_from's SOURCE (the model a continued run started from); None (default) snapshots the EMA
            teacher at that step.
        gram_resolution_scale: the Gram teacher's own crops (the datamodule cuts them: each global crop's box
            and flip, undistorted) at this x the global side, 1 (default) to 2 (DINOv3's; 1.5 in its
            high-resolution stage); its patch features
            are resized bicubically to the student's grid.
        gram_remove_negative: count negative similarities as 0 on both sides (DINOv3's ``remove_neg``; off, as in
            its 7B config).
        sync_every_n_steps: optimiser steps (accumulation windows, not micro-batches) between the host's reads
            of the device (the finite-loss check, the collapse guard's signals). Each read waits for the GPU
            queue to drain; a non-finite loss is then reported (and a collapse seen) up to this many steps
            late, but never saved: a checkpoint is written only after a read (docs/training.md).
        init_from: start a fresh fit from pretrained weights (continued pretraining): a checkpoint or export
            of ours, an official DINO file, or ``timm:NAME[@FILE]`` (``ssl_xcit.dino.init_from``, docs/training.md).
        init_from_ema: start the student from SOURCE's EMA network too (its teacher, or a ``dinov3``
            distillation's student EMA), as DINOv3's ``resume_from_teacher_chkpt`` does; false: the student from
            SOURCE's student, where SOURCE has one.
        init_head_warmup_steps: optimiser steps during which only the head trains after ``init_from``
            (null: automatic, a few steps when SOURCE lacks any of the model's heads, DINO or iBOT, else 0).
        clip_mode: ``per_parameter`` (DINO's ``utils.clip_gradients``: each gradient tensor to norm
            ``clip_grad``) or ``per_module`` (DINOv3's ``train.py``: ``clip_grad_norm_`` of the student's backbone,
            DINO head and iBOT head, each as one vector; far stricter at the same ``clip_grad``).
        layerwise_decay: lr multiplier ``layerwise_decay ** (depth + 1 - layer id)`` of each backbone parameter
            (DINOv3's ``param_groups.py``: embeddings and tokens are layer 0, block i is i + 1, the final norm
            and heads depth + 1); 1.0 (default) is off, DINOv3 uses 0.98-0.99. Backbones with ``blocks``
            (xcit, vit, cait, bixt, dinov3) only.
        patch_embed_lr_mult: an extra lr multiplier of the patch embedding (DINOv3: 0.2; 1.0 is off).
        lr_scaling_rule: with ``scale_lr_with_batch``, ``linear_wrt_256`` (DINO: lr x batch / 256) or
            ``sqrt_wrt_1024`` (DINOv3: lr and min_lr x 4 sqrt(batch / 1024)).
        final_momentum_teacher: the EMA momentum's end on its cosine from ``momentum_teacher`` (1.0, DINO's);
            equal to ``momentum_teacher`` holds it constant (DINOv3's Gram and high-resolution stages: 0.999).
        local_crops_weight: the weight of the DINO term's local-crop pairs, reached from 1 along the Gram ramp
            (``gram_start_step``, ``gram_weight_warmup_steps``) and held (DINOv3's 7B run: 0.5; 1.0 is off).
        teacher_mode: the mode the EMA and Gram teachers run in while training: ``train`` (DINO's reference:
            XCiT's BatchNorms with batch statistics) or ``eval`` (DINOv3's: no train-time augmentation such as
            RoPE's coordinate rescaling in the targets; BatchNorms with running statistics).
    """

    # Whether meta_start() (the CLI under --trainer.strategy fsdp2) builds the networks on the meta device.
    builds_on_meta = True

    def __init__(
        self,
        backbone: str = "xcit_small_12_p16",
        drop_path_rate: float = 0.1,
        backbone_kwargs: dict[str, Any] | None = None,
        out_dim: int = 65536,
        norm_last_layer: bool = True,
        head_last_layer: Literal["weight_norm", "linear"] = "weight_norm",
        use_bn_in_head: bool = False,
        head_hidden_dim: int = 2048,
        head_bottleneck_dim: int = 256,
        head_nlayers: int = 3,
        warmup_teacher_temp: float = 0.04,
        teacher_temp: float = 0.04,
        warmup_teacher_temp_epochs: int = 0,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        centering: Literal["ema", "sinkhorn_knopp"] = "ema",
        momentum_teacher: float = 0.996,
        lr: float = 0.0005,
        min_lr: float = 1e-6,
        warmup_epochs: int = 10,
        weight_decay: float = 0.04,
        weight_decay_end: float = 0.4,
        clip_grad: float = 3.0,
        freeze_last_layer: int = 1,
        optimizer: Literal["adamw", "sgd", "lars"] = "adamw",
        fused_optimizer: bool | None = None,
        scale_lr_with_batch: bool = True,
        accumulate_grad_batches: int = 1,
        sync_batchnorm: bool = True,
        compile: bool = False,
        activation_checkpointing: bool = False,
        collapse_guard: Literal["warn", "stop", "off"] = "warn",
        collapse_patience: int = 50,
        collapse_grace_steps: int = 100,
        koleo_weight: float = 0.0,
        koleo_group_size: int | None = None,
        ibot_loss_weight: float = 0.0,
        ibot_separate_head: bool = True,
        ibot_out_dim: int | None = None,
        ibot_warmup_teacher_temp: float | None = None,
        ibot_teacher_temp: float | None = None,
        ibot_warmup_teacher_temp_epochs: int | None = None,
        ibot_weight_warmup_epochs: float = 0.0,
        ibot_bn_stats: Literal["all", "unmasked"] = "all",
        mask_ratio_min_max: tuple[float, float] = (0.1, 0.5),
        mask_probability: float = 0.5,
        gram_loss_weight: float = 0.0,
        gram_start_step: int = 0,
        gram_weight_warmup_steps: int = 0,
        gram_refresh_every: int = 0,
        gram_max_refreshes: int = 3,
        gram_teacher: str | None = None,
        gram_resolution_scale: int | float = 1,
        gram_remove_negative: bool = False,
        sync_every_n_steps: int = 50,
        init_from: str | None = None,
        init_head_warmup_steps: int | None = None,
        clip_mode: Literal["per_parameter", "per_module"] = "per_parameter",
        layerwise_decay: float = 1.0,
        patch_embed_lr_mult: float = 1.0,
        lr_scaling_rule: Literal["linear_wrt_256", "sqrt_wrt_1024"] = "linear_wrt_256",
        final_momentum_teacher: float = 1.0,
        local_crops_weight: float = 1.0,
        teacher_mode: Literal["train", "eval"] = "train",
        init_from_ema: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Options a subclass resolves before passing them (Distill: None picks its objective's reference): under
        # LightningCLI the hyperparameters are the command line's config, so they take the values received here.
        self.hparams.update(
            clip_mode=clip_mode,
            layerwise_decay=layerwise_decay,
            patch_embed_lr_mult=patch_embed_lr_mult,
            lr_scaling_rule=lr_scaling_rule,
            head_last_layer=head_last_layer,
        )
        self.automatic_optimization = False
        check_settings(self.hparams)
        check_init_settings(init_from, init_head_warmup_steps)
        ibot_out_dim = out_dim if ibot_out_dim is None else ibot_out_dim
        self.ibot = ibot_loss_weight > 0
        # Under --trainer.strategy fsdp2 the networks start on the meta device and configure_model materialises
        # each rank's shards (ssl_xcit.parallel.meta_start); the recipe replays this construction exactly.
        with recorded_construction(self.builds_on_meta) as self._meta_recipe:
            self.student, self.teacher = student_and_teacher(
                create_model,
                backbone,
                dict(backbone_kwargs or {}),
                drop_path_rate,
                dict(
                    out_dim=out_dim,
                    use_bn=use_bn_in_head,
                    nlayers=head_nlayers,
                    hidden_dim=head_hidden_dim,
                    bottleneck_dim=head_bottleneck_dim,
                    norm_last_layer=norm_last_layer,
                    last_layer=head_last_layer,
                ),
                patch_out_dim=(ibot_out_dim if ibot_separate_head else None) if self.ibot else None,
                masking=self.ibot,
                mask_token=getattr(self, "masks_student", True),  # Distill under dinov3: never masked
            )
        if activation_checkpointing:  # the student only: the teachers run without gradients
            enable_activation_checkpointing(self.student.backbone)
        self.dino_loss = DINOLoss(
            out_dim,
            warmup_teacher_temp=warmup_teacher_temp,
            teacher_temp=teacher_temp,
            warmup_teacher_temp_epochs=warmup_teacher_temp_epochs,
            student_temp=student_temp,
            center_momentum=center_momentum,
            centering=centering,
            num_global_crops=NUM_GLOBAL_CROPS,
        )
        if self.ibot:  # the patch term's own temperatures default to the DINO term's (DINOv2)
            self.ibot_loss = iBOTPatchLoss(
                ibot_out_dim,
                warmup_teacher_temp=_pick(ibot_warmup_teacher_temp, warmup_teacher_temp),
                teacher_temp=_pick(ibot_teacher_temp, teacher_temp),
                warmup_teacher_temp_epochs=_pick(ibot_warmup_teacher_temp_epochs, warmup_teacher_temp_epochs),
                student_temp=student_temp,
                center_momentum=center_momentum,
                centering=centering,
            )
        # The centres move once per optimiser step (``_optimizer_step``), like every schedule: accumulated
        # micro-batches move them as one step over their concatenation would.
        for targets in self._teacher_targets():
            targets.defer_center = True
        # Gram anchoring (ssl_xcit.dino.gram): the frozen Gram teacher, or None when off.
        with meta_device_if(self._meta_recipe is not None):  # taken from the teacher once materialised
            self.gram_teacher = build_gram_teacher(self.hparams, self.student, self.teacher)
        if self.gram_teacher is not None:  # DINOv3 runs its Gram teacher in eval mode, as its EMA teacher
            self.gram_teacher.eval_mode = teacher_mode == "eval"
        self.gram_weight_now = 0.0  # this step's weight, a host float
        self.local_weight_now = 1.0  # this step's weight of the local crops' DINO pairs, a host float
        self.mask_sampler = MaskSampler(tuple(mask_ratio_min_max), mask_probability) if self.ibot else None
        self.ibot_out_dim = ibot_out_dim
        self.ibot_weight_now = float(ibot_loss_weight)  # this step's weight, from the schedule while training
        self.schedules: Schedules | None = None
        self.skipped_batches = 0  # batches skipped because a rank had no readable image
        # (teacher entropy, KL to uniform) of the last step as device tensors, for the DINO and iBOT terms:
        # the collapse guard reads them every sync_every_n_steps steps.
        self.signal_tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._finite = FiniteWatch()
        # Host values for the progress bar (``ssl_xcit.trainer.progress``), refreshed by the reads above only.
        self.progress_values: dict[str, float] = {}
        self._agree = HostAgreement()
        self._steps_since_read = 0
        self._window_backwards = 0  # micro-batches of the current window that ran a backward (host count)
        self.window_closed = True  # whether the last training batch ended a window (the collapse guard asks)
        self._compiled = False
        self._restored_progress: tuple[int, int] | None = None  # (epoch, global step) of a loaded checkpoint
        self.init_state: dict[str, Any] | None = None  # init_from's record (ssl_xcit.dino.init_from)

    # ------------------------------------------------------------------------------------------- training
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Teacher backbone embedding (the network one exports and evaluates). After ``eval()`` each image's
        embedding is independent of the rest of its batch."""
        return self.teacher.backbone(x)

    def draw_masks(self, global_crop: torch.Tensor, seed: list[int]) -> MaskedPatches:
        """iBOT's block masks for the 2 x B global crops of ``global_crop``'s shape and device, drawn on the
        host from ``seed``."""
        grid = self.student.backbone.token_grid(*global_crop.shape[-2:])
        masks = self.mask_sampler(grid, NUM_GLOBAL_CROPS * global_crop.shape[0], seed)
        return MaskedPatches.from_host(masks, global_crop.device)

    def compute_losses(
        self,
        crops: list[torch.Tensor],
        masks: MaskedPatches | None,
        epoch: int,
        update_center: bool,
        gram_crops: list[torch.Tensor] | None = None,
    ) -> StepLosses:
        """This step's math (``ssl_xcit.dino.step.compute_losses``), shared by training and validation."""
        return compute_losses(self, crops, masks, epoch, update_center, gram_crops)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        self._build_schedules()
        accumulate = self.hparams.accumulate_grad_batches
        # The micro-batches after the last full accumulation window cannot make a step; they are dropped,
        # as the schedules (sized on whole windows) assume. Every rank has the same batch count.
        if batch_idx >= self.schedules.iters_per_epoch * accumulate:
            self.window_closed = False
            return None
        window_end = self.window_closed = (batch_idx + 1) % accumulate == 0
        opt = self.optimizers()
        lr, wd, momentum = self.schedules.at(self.global_step)
        self.ibot_weight_now = self.schedules.ibot_weight_at(self.global_step)
        self.local_weight_now = self._local_weight(self.global_step)
        self._update_gram_teacher(self.global_step)
        crops = self._readable_crops(batch)
        if crops is None:  # every rank skips this batch
            self.skipped_batches += 1
            if window_end:  # no backward reduces what the window's readable micro-batches accumulated
                self._optimizer_step(opt, momentum, reduce=self._window_backwards > 0)
            log_host_scalars(self, lr, wd, momentum)
            self._count_window(window_end)
            return None
        apply_schedules(opt, lr, wd)  # each group's lr multiplier; weight decay on the regularised groups
        masks = None
        if self.ibot:  # seeded by (run seed, rank, step, batch): a resumed run draws the same masks
            seed = [torch.initial_seed() % 2**63, self.global_rank, self.global_step, batch_idx]
            masks = self.draw_masks(crops[0], seed)
        gram = gram_crops_from_batch(batch)  # the Gram teacher's crops (None when the model does not anchor)
        out = self.compute_losses(crops, masks, self.current_epoch, update_center=True, gram_crops=gram)
        self._finite.observe(out.total, self.global_step)
        with gradient_sync(self.trainer, window_end):
            self.manual_backward(out.total / accumulate)
        self._window_backwards += 1
        if window_end:
            self._optimizer_step(opt, momentum)
        log_losses(self, "train", out)
        log_host_scalars(self, lr, wd, momentum)
        if out.dino is not None:
            self.signal_tensors["dino"] = (out.dino.teacher_entropy, out.dino.kl_to_uniform)
        if out.ibot is not None:
            self.signal_tensors["ibot"] = (out.ibot.teacher_entropy, out.ibot.kl_to_uniform)
        self._count_window(window_end)
        return out.total.detach()

    def _count_window(self, window_end: bool) -> None:
        """``sync_every_n_steps`` counts optimiser steps (windows), not micro-batches: read at every N-th end."""
        if window_end:
            self._steps_since_read += 1
            if self._steps_since_read >= self.hparams.sync_every_n_steps:
                self._read_finite()

    def _update_gram_teacher(self, step: int) -> None:
        """Gram anchoring's snapshot or refresh before ``step``'s forward, and the step's weight (host only)."""
        if self.gram_teacher is not None:
            self.gram_teacher.update(self.teacher.backbone, step)
        self.gram_weight_now = gram_weight(self.gram_teacher, self.schedules, step)

    def _local_weight(self, step: int) -> float:
        """The local crops' DINO weight at optimiser ``step`` (``local_crops_weight`` on the Gram ramp)."""
        if self.schedules is not None:
            return self.schedules.local_weight_at(step)
        hp = self.hparams  # validate/test without a fit: the same ramp, sized to reach ``step``
        ramp = local_weight_ramp(
            hp.local_crops_weight, hp.gram_start_step, hp.gram_weight_warmup_steps, step + 1
        )
        return 1.0 if ramp is None else float(ramp[step])

    def _readable_crops(self, batch: Any, skip_single_view: bool = False) -> list[torch.Tensor] | None:
        """The batch's crops, or None on every rank when any rank has no readable image (EmptyBatch or None)
        or, with ``skip_single_view``, fewer than 3 crops (an evaluation transform). The ranks agree on the
        host, so none waits in a collective (centre and Sinkhorn all-reduces, DDP's gradient reduction,
        synced BN) another never enters."""
        empty = batch is None or isinstance(batch, EmptyBatch)
        crops = [] if empty else crops_from_batch(batch)
        if self._agree.any(empty or (skip_single_view and len(crops) < NUM_GLOBAL_CROPS + 1)):
            return None
        if len(crops) < NUM_GLOBAL_CROPS:
            raise UserError(
                f"DINO needs at least {NUM_GLOBAL_CROPS} (global) crops per image, got {len(crops)}"
            )
        return crops

    def _teacher_targets(self) -> list[TeacherTargets]:
        return [self.dino_loss, *([self.ibot_loss] if self.ibot else [])]

    def _optimizer_step(self, opt: Any, momentum: float, reduce: bool = False) -> None:
        """The window's end (``ssl_xcit.dino.optimizer_step.window_step``): centres, step, EMA."""
        window_step(self, opt, momentum, reduce and self.trainer.world_size > 1, self._window_backwards)
        self._window_backwards = 0

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called by the precision plugin after the callbacks' hook, on true gradients: clip and cancel as the
        # reference.
        before_optimizer_step(self, optimizer)

    def _update_teacher(self, momentum: float) -> None:
        ema_update(self.teacher, self.student, momentum)

    # ----------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        """The training loss (``compute_losses``: DINO, KoLeo and iBOT terms) on held-out multi-crop batches,
        with centres, BatchNorm statistics and the training mask draws untouched. Single-view batches (an
        evaluation transform) have no loss and are skipped, as are batches with no readable image; the ranks
        skip together, as in training."""
        crops = self._readable_crops(batch, skip_single_view=True)
        if crops is None:
            return None
        self.gram_weight_now = gram_weight(self.gram_teacher, self.schedules, self.trained_step)
        self.local_weight_now = self._local_weight(self.trained_step)
        masks = None
        if self.ibot:  # a stream of its own (the trailing 1): validation never replays a training draw
            seed = [torch.initial_seed() % 2**63, self.global_rank, self.trained_step, batch_idx, 1]
            masks = self.draw_masks(crops[0], seed)
        with torch.no_grad(), buffers_preserved(self):
            gram = gram_crops_from_batch(batch)
            out = self.compute_losses(crops, masks, self.trained_epoch, update_center=False, gram_crops=gram)
        log_losses(self, "val", out)
        return out.total
