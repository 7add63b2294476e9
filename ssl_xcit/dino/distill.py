"""Distillation from a frozen teacher: ``ssl-xcit fit -c recipes/distill.yaml --model.teacher SOURCE``.

The teacher (``ssl_xcit.dino.distill_teacher``) is any SOURCE ``--model.init_from`` reads (a checkpoint or
export of ours, an official DINO file) or ``timm:NAME[@FILE]`` for a timm model whose ``forward_features`` gives
patch tokens; its embedding is its CLS token, or its pooled embedding when it has no class token. It is frozen:
eval mode whoever calls ``train()``, no gradients, and not saved in checkpoints (it is an input, read again from
SOURCE when a run resumes), so every reader of a distillation checkpoint (``export``, ``knn``, ``linear``,
``embed``, ``visualize``, ``--model.init_from``) takes the distilled network: the student, or its EMA under
``dinov3``. It may have another width, patch size and input resolution (``teacher_resolution``) than the
student.

Three objectives:

* ``dinov3``: distillation as DINOv3 runs it (``multidist_meta_arch.py``, ``ssl_meta_arch.py`` with
  ``distillation.enabled``). The DINO loss of all the student's crops (global and local) against the frozen
  teacher's head outputs on the global crops, Sinkhorn-Knopp targets, KoLeo, and iBOT's term (with
  ``ibot_loss_weight`` > 0) at the mask positions of an *unmasked* student: the masks only pick the patches
  where the student's patch head is trained towards the teacher's. A student EMA (``ssl_xcit.dino.student_ema``,
  momentum ``momentum_teacher`` -> 1 on a cosine; DINOv3: 0.994) is the network evaluated and exported.
* ``dino``: DINOv2-style distillation, as this module had it first: the same losses, but the student's global
  crops are masked for iBOT as in self-distillation, and the student itself is the product (no EMA).
* ``features``: token regression (``ssl_xcit.dino.distill_features``); any teacher, global crops only.

The teacher runs once per step, under ``no_grad``, on all global crops together (``benchmarks/bench_distill.py``
measures its share of a step). Everything else is DINO's (``ssl_xcit.dino.module``): schedules, manual
optimisation, clipping, mixed precision, resume, checkpoints, the finite-loss check and the online k-NN, which
judges ``evaluated_network``. docs/training.md lists where this still differs from DINOv3.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from ssl_xcit.dino.distill_features import FeatureProjection, align_grid, features_loss, normalise_tokens
from ssl_xcit.dino.distill_teacher import OPTION as _OPTION
from ssl_xcit.dino.distill_teacher import FrozenTeacher, head_from_state, read_teacher
from ssl_xcit.dino.ibot import MaskedPatches
from ssl_xcit.dino.koleo import koleo_loss
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.optim import objective_optimisation
from ssl_xcit.dino.step import NUM_GLOBAL_CROPS, StepLosses
from ssl_xcit.dino.student_ema import ema_update_
from ssl_xcit.errors import UserError
from ssl_xcit.parallel.meta_start import meta_start_enabled

OBJECTIVES = ("dino", "dinov3", "features")
_HEADED = ("dino", "dinov3")  # the objectives that distil from the teacher's DINO head
__all__ = [
    "OBJECTIVES",
    "Distill",
    "FeatureProjection",
    "FrozenTeacher",
    "align_grid",
    "features_loss",
    "head_from_state",
    "normalise_tokens",
    "read_teacher",
]


# ---------------------------------------------------------------------------------------------- the module
class Distill(DINO):
    """A student trained against a frozen teacher (see the module docstring).

    Args:
        teacher: SOURCE of the teacher: a ``.ckpt``, ``.safetensors`` or ``.pth`` of ours, an official DINO
            file, or ``timm:NAME[@FILE]``.
        objective: ``dinov3`` (DINOv3's distillation: unmasked student, iBOT at the mask positions, the student
            EMA evaluated and exported), ``dino`` (the same losses with a masked student and no EMA) or
            ``features`` (token regression); see the module docstring.
        teacher_resolution: side of the square input the teacher sees; the global crops are resized to it
            (None: the global crop size, no resize).
        teacher_to_student_resolution_scale: the teacher sees the global crops as the data gives them, the
            student sees them downsampled by this factor (bilinear, antialiased), so a ConvNeXt student (stride
            32) meets a ViT/16 teacher's patch grid at 2.0 (DINOv3's ConvNeXt distillation configs,
            dinov3/configs/train/distillation_convnext/*.yaml: ``crops.teacher_to_student_resolution_scale``).
            Its iBOT masks are drawn on the student's grid. 1.0: both see the same crops.
        head_last_layer: the student heads' last layer; None picks each objective's reference: ``linear``
            (DINOv3's plain trainable layer, dinov3/layers/dino_head.py) under ``dinov3``, ``weight_norm``
            otherwise.
        clip_mode, layerwise_decay, patch_embed_lr_mult, lr_scaling_rule: DINO's options (``ssl_xcit.dino.module``);
            None picks the objective's reference: DINOv3's distillation values under ``dinov3`` (``per_module``,
            0.99, 0.2, ``sqrt_wrt_1024``: dinov3/configs/train/dinov3_vitl16_lvd1689m_distilled.yaml; no layer-wise
            decay for a student without blocks, as DINOv3's rule gives), DINO's otherwise.
        cls_weight, patch_weight: weights of the CLS and patch terms of the ``features`` objective.
        **kwargs: DINO's settings (student backbone, optimisation, schedules; ``out_dim`` and ``ibot_out_dim``
            come from the teacher's heads under ``dino`` and ``dinov3``; ``momentum_teacher`` is the student
            EMA's starting momentum under ``dinov3``, raised to 1 on a cosine).
    """

    evaluated_network = "student"  # the online k-NN, export and knn read it (student_ema under dinov3)
    # Built whole even under meta_start(): the student's head and EMA are made after DINO's networks.
    builds_on_meta = False

    def __init__(
        self,
        teacher: str | None = None,
        objective: Literal["dino", "dinov3", "features"] = "features",
        teacher_resolution: int | None = None,
        teacher_to_student_resolution_scale: float = 1.0,
        head_last_layer: Literal["weight_norm", "linear"] | None = None,
        clip_mode: Literal["per_parameter", "per_module"] | None = None,
        layerwise_decay: float | None = None,
        patch_embed_lr_mult: float | None = None,
        lr_scaling_rule: Literal["linear_wrt_256", "sqrt_wrt_1024"] | None = None,
        cls_weight: float = 1.0,
        patch_weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        if objective not in OBJECTIVES:
            raise UserError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if teacher_resolution is not None and int(teacher_resolution) < 1:
            raise UserError(
                f"teacher_resolution must be a positive side in pixels or null, got {teacher_resolution}"
            )
        scale = float(teacher_to_student_resolution_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise UserError(
                "teacher_to_student_resolution_scale must be a positive factor (1.0: no downsampling, DINOv3's "
                f"ConvNeXt distillation 2.0), got {teacher_to_student_resolution_scale}"
            )
        if scale != 1.0 and teacher_resolution is not None:
            raise UserError(
                f"teacher_resolution {teacher_resolution} and teacher_to_student_resolution_scale {scale} both "
                "resize a side: set one (the scale keeps the teacher at the data's crop size)"
            )
        if not (cls_weight >= 0 and patch_weight >= 0 and cls_weight + patch_weight > 0):
            raise UserError(
                f"cls_weight and patch_weight must be >= 0, not both 0; got {cls_weight}, {patch_weight}"
            )
        if kwargs.get("init_from"):
            raise UserError(
                "init_from does not apply to distillation: the student starts fresh (set --model.teacher)"
            )
        if float(kwargs.get("gram_loss_weight", 0.0)) > 0:
            # The frozen teacher already anchors the student's patch tokens; the step computes no Gram term.
            raise UserError(
                f"gram_loss_weight does not apply to distillation, got {kwargs['gram_loss_weight']}: set it to 0 "
                "(the frozen teacher anchors the patch tokens)"
            )
        # Reading the teacher (a timm model is built with random weights first) must not draw from the global
        # RNG: under one seed the student starts from exactly the weights DINO from random init would, so the
        # two can be compared from one starting point (benchmarks/learning.py --distill).
        with torch.random.fork_rng(devices=[]):
            frozen = read_teacher(teacher, on_meta=meta_start_enabled())  # FSDP2: loaded after sharding
        ibot = float(kwargs.get("ibot_loss_weight", 0.0)) > 0
        # DINOv3 never masks a distilled student (its masks only pick where the patch head learns), so its
        # backbone needs no mask token: a ConvNeXt, which cannot take masks, distils with iBOT.
        self.masks_student = objective != "dinov3"
        # Resolved in place: the saved hyperparameters (read from this frame) record the layer that was built.
        if head_last_layer is None:
            head_last_layer = "linear" if objective == "dinov3" else "weight_norm"
        kwargs["head_last_layer"] = head_last_layer
        # None: the objective's reference (DINO's options, ssl_xcit.dino.module), DINOv3's distillation values
        # under dinov3 (dinov3/configs/train/dinov3_vitl16_lvd1689m_distilled.yaml; ssl_xcit.dino.optim).
        kwargs.update(
            objective_optimisation(
                objective == "dinov3",
                kwargs.get("backbone", inspect.signature(DINO).parameters["backbone"].default),
                clip_mode=clip_mode,
                layerwise_decay=layerwise_decay,
                patch_embed_lr_mult=patch_embed_lr_mult,
                lr_scaling_rule=lr_scaling_rule,
            )
        )
        if objective in _HEADED:
            if frozen.head is None:
                raise UserError(
                    f"{_OPTION} {teacher} has no DINO head, which the {objective} objective distils from: use "
                    "--model.objective features, or a checkpoint of ours or an official full DINO checkpoint"
                )
            if ibot and frozen.patch_head is None:
                raise UserError(
                    f"{_OPTION} {teacher} has no iBOT patch head, which iBOT's term distils from: set "
                    "ibot_loss_weight 0 or use a teacher trained with iBOT and a separate patch head"
                )
            kwargs["out_dim"] = frozen.head.out_dim
            if ibot:
                kwargs.update(ibot_out_dim=frozen.patch_head.out_dim, ibot_separate_head=True)
        elif ibot:
            raise UserError(
                "ibot_loss_weight > 0 needs --model.objective dinov3 or dino (the features objective has no iBOT "
                "term)"
            )
        super().__init__(**kwargs)
        self.student.head = (
            FeatureProjection(
                self.student.backbone.embed_dim,
                self.student.backbone.embed_dim,
                frozen.cls_dim,
                frozen.patch_dim,
            )
            if objective == "features"
            else self.student.head
        )
        self.teacher = frozen  # replaces DINO's EMA copy; never saved (state_dict) nor trained
        if objective == "dinov3":  # DINOv3's model_ema: a copy of the student (backbone and heads)
            mask_token = getattr(self.student.backbone, "mask_token", None)
            if isinstance(mask_token, torch.nn.Parameter):  # an unmasked student never reads it (nor DDP)
                mask_token.requires_grad_(False)
            self.student_ema = copy.deepcopy(self.student)
            self.student_ema.requires_grad_(False)
            self.student_ema.train(False)
            self.evaluated_network = "student_ema"
        self._warned_no_local_crops = False
        rank_zero_info(
            f"distillation ({objective}) from {teacher}: teacher widths {frozen.cls_dim} (CLS) / "
            f"{frozen.patch_dim} (patches)"
            + (f", {kwargs['out_dim']} prototypes" if objective in _HEADED else "")
        )

    # ------------------------------------------------------------------------------ the frozen teacher
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state = super().state_dict(*args, **kwargs)
        prefix = (args[1] if len(args) > 1 else kwargs.get("prefix", "")) + "teacher."
        for key in [k for k in state if k.startswith(prefix)]:
            del state[key]
        return state

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        # The teacher comes from SOURCE, never from a checkpoint: its own tensors fill the keys it lacks.
        state = {f"teacher.{k}": v for k, v in self.teacher.state_dict().items()}
        state.update({k: v for k, v in state_dict.items() if not k.startswith("teacher.")})
        return super().load_state_dict(state, strict=strict, assign=assign)

    def _set_training_modes(self) -> None:
        self.student.train(True)
        self.teacher.train(False)
        if hasattr(self, "student_ema"):
            self.student_ema.train(False)  # never run forward in training; evaluated in eval mode

    def configure_model(self) -> None:
        from ssl_xcit.parallel.fsdp import is_fsdp2, shard_module
        from ssl_xcit.parallel.meta_start import capture_all, fill
        from ssl_xcit.parallel.syncbn import convert_sync_batchnorm, has_batchnorms

        world_size = self.trainer.world_size
        recipe = getattr(self.teacher, "meta_recipe", None)  # a teacher on the meta device (read_teacher)
        targets = capture_all(self.teacher.backbone) if recipe is not None else None
        if self.hparams.sync_batchnorm and world_size > 1 and has_batchnorms(self.student):
            self.student = convert_sync_batchnorm(self.student)
        if is_fsdp2(self.trainer):
            shard_module(self, self.trainer.strategy.data_parallel_mesh, str(self.trainer.precision))
        if recipe is not None:  # each rank's shards of the teacher's backbone, read from SOURCE
            device = self.trainer.strategy.root_device if is_fsdp2(self.trainer) else torch.device("cpu")
            self.teacher.backbone.to_empty(device=device)
            fill(self.teacher.backbone, recipe, targets, device)
            self.teacher.meta_recipe = None
        if self.hparams.compile and not self._compiled:
            self.student.compile_backbone()
            self.teacher.backbone.compile(dynamic=False)
            self._compiled = True

    def configure_callbacks(self) -> list:
        # The collapse guard watches a teacher distribution, which the features objective has not.
        return super().configure_callbacks() if self.hparams.objective in _HEADED else []

    def on_fit_start(self) -> None:
        pass  # no init_from: the student starts fresh, the teacher was read at construction

    def _update_teacher(self, momentum: float) -> None:
        # The teacher is frozen; under dinov3 the student EMA takes this step's momentum (DINO's schedule:
        # momentum_teacher -> 1 on a cosine, DINOv3's 0.994 -> 1), after the optimiser step as DINOv3's.
        if hasattr(self, "student_ema"):
            ema_update_(self.student_ema, self.student, momentum)

    def forward(self, x: Tensor) -> Tensor:
        """The distilled network's embedding: the student's backbone, or its EMA's under ``dinov3``."""
        return getattr(self, self.evaluated_network).backbone(x)

    # --------------------------------------------------------------------------------------- the step
    def student_side(self, height: int, width: int) -> tuple[int, int]:
        """The size of the student's global crops, for the data's ``height`` x ``width`` ones."""
        scale = float(self.hparams.teacher_to_student_resolution_scale)
        return (height, width) if scale == 1.0 else (round(height / scale), round(width / scale))

    def student_crops(self, crops: list[Tensor]) -> list[Tensor]:
        """``crops`` as the student sees them: the global ones downsampled by
        ``teacher_to_student_resolution_scale`` (bilinear, antialiased, as DINOv3's multidist_meta_arch.py),
        the local ones as they are."""
        size = self.student_side(*crops[0].shape[-2:])
        if size == tuple(crops[0].shape[-2:]):
            return crops
        scaled = [
            F.interpolate(c, size=size, mode="bilinear", align_corners=False, antialias=True)
            for c in crops[:NUM_GLOBAL_CROPS]
        ]
        return scaled + list(crops[NUM_GLOBAL_CROPS:])

    def draw_masks(self, global_crop: Tensor, seed: list[int]) -> MaskedPatches:
        # On the student's patch grid: an empty stand-in of the downsampled crop's shape and device.
        shape = (global_crop.shape[0], 0, *self.student_side(*global_crop.shape[-2:]))
        return super().draw_masks(global_crop.new_empty(shape), seed)

    def teacher_tokens(self, global_crops: Tensor) -> tuple[Tensor, Tensor]:
        """The teacher's CLS and patch tokens of all global crops (G*B, 3, H, W) in one forward, no grad, at
        ``teacher_resolution``."""
        side = self.hparams.teacher_resolution
        with torch.no_grad():
            if side is not None and tuple(global_crops.shape[-2:]) != (side, side):
                global_crops = F.interpolate(
                    global_crops, size=(side, side), mode="bilinear", align_corners=False, antialias=True
                )
            return self.teacher.tokens(global_crops)

    def compute_losses(
        self,
        crops: list[Tensor],
        masks: MaskedPatches | None,
        epoch: int,
        update_center: bool,
        gram_crops: list[Tensor] | None = None,  # always None: Gram anchoring is refused here (__init__)
    ) -> StepLosses:
        batch_size = crops[0].shape[0]
        sizes = {tuple(c.shape[-2:]) for c in crops[:NUM_GLOBAL_CROPS]}
        if len(sizes) != 1:
            raise ValueError(
                f"distillation needs {NUM_GLOBAL_CROPS} global crops of one size, got {sorted(sizes)}"
            )
        teacher_cls, teacher_patches = self.teacher_tokens(torch.cat(crops[:NUM_GLOBAL_CROPS]))
        crops = self.student_crops(crops)
        if self.hparams.objective == "features":
            global_crops = torch.cat(crops[:NUM_GLOBAL_CROPS])
            return self._features_losses(global_crops, teacher_cls, teacher_patches, batch_size)
        if self.hparams.objective == "dinov3" and len(crops) == NUM_GLOBAL_CROPS:
            self._warn_no_local_crops()
        return self._dino_losses(crops, masks, teacher_cls, teacher_patches, epoch, update_center, batch_size)

    def _features_losses(
        self, global_crops: Tensor, teacher_cls: Tensor, teacher_patches: Tensor, batch_size: int
    ) -> StepLosses:
        hp = self.hparams
        embedding, patches = self.student.backbone.forward_cls_patches(global_crops)
        grid = self.student.backbone.token_grid(*global_crops.shape[-2:])
        target = align_grid(teacher_patches.float(), grid).flatten(1, 2)
        proj = self.student.head
        cls, patch = features_loss(proj.cls_proj(embedding), proj.patch_proj(patches), teacher_cls, target)
        total = hp.cls_weight * cls + hp.patch_weight * patch
        terms = {"cls_loss": cls, "patch_loss": patch}
        total, koleo = self._with_koleo(total, embedding, batch_size)
        return StepLosses(total, None, koleo, None, batch_size, terms)

    def _dino_losses(
        self,
        crops: list[Tensor],
        masks: MaskedPatches | None,
        teacher_cls: Tensor,
        teacher_patches: Tensor,
        epoch: int,
        update_center: bool,
        batch_size: int,
    ) -> StepLosses:
        with torch.no_grad():
            teacher_output = self.teacher.head(teacher_cls)
        patch = None
        if masks is not None:
            # dinov3: the student sees its global crops whole (DINOv3 passes no masks to a distilled
            # student); the masks only choose where its patch head learns the teacher's. dino: masked.
            student_masks = None if self.hparams.objective == "dinov3" else masks.masks
            student_output, embedding, student_tokens = self.student.forward_with_patches(
                crops, student_masks, n_global=NUM_GLOBAL_CROPS
            )
            grid = self.student.backbone.token_grid(*crops[0].shape[-2:])
            with torch.no_grad():
                aligned = align_grid(teacher_patches, grid).flatten(1, 2)
                teacher_patch_logits = self.teacher.patch_head(masks.select(aligned))
            student_patch_logits = self.student.patch_logits(masks.select(student_tokens))
        else:
            student_output, embedding = self.student(crops, return_embeddings=True)
        dino = self.dino_loss(student_output, teacher_output, epoch, update_center=update_center)
        total, koleo = self._with_koleo(dino.loss, embedding[: NUM_GLOBAL_CROPS * batch_size], batch_size)
        if masks is not None:
            patch = self.ibot_loss(
                student_patch_logits, teacher_patch_logits, masks, epoch, update_center=update_center
            )
            total = total + self.ibot_weight_now * patch.loss
        return StepLosses(total, dino, koleo, patch, batch_size)

    def _with_koleo(
        self, total: Tensor, global_embedding: Tensor, batch_size: int
    ) -> tuple[Tensor, Tensor | None]:
        """``total`` + koleo_weight x KoLeo per global view (as DINO's step), and the KoLeo term."""
        weight = self.hparams.koleo_weight
        if weight <= 0:
            return total, None
        if batch_size < 2:
            koleo = global_embedding.new_zeros((), dtype=torch.float32)
        else:
            koleo = sum(koleo_loss(view) for view in global_embedding.chunk(NUM_GLOBAL_CROPS))
        return total + weight * koleo, koleo

    def _warn_no_local_crops(self) -> None:
        if not self._warned_no_local_crops:
            self._warned_no_local_crops = True
            rank_zero_warn(
                "the dinov3 objective gets no local crops: DINOv3 gives the student 8 (--data.local_crops_number 8)"
            )
