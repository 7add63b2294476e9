"""Distillation from a frozen teacher: ``ssl-xcit fit -c recipes/distill.yaml --model.teacher SOURCE``.

The teacher is any SOURCE ``--model.init_from`` reads (a checkpoint or export of ours, an official DINO file) or
``timm:NAME[@FILE]`` for any timm model whose ``forward_features`` gives a CLS token and patch tokens. It is
frozen: eval mode whoever calls ``train()``, no gradients, and not saved in checkpoints (it is an input, read
again from SOURCE when a run resumes), so every reader of a distillation checkpoint (``export``, ``knn``,
``linear``, ``embed``, ``visualize``, ``--model.init_from``) takes the student. It may have another width, patch
size and input resolution (``teacher_resolution``) than the student.

Two objectives:

* ``dino``: DINOv2's distillation. The DINO loss (and iBOT's when ``ibot_loss_weight`` > 0) of the student
  against the frozen teacher's own head outputs, centred (EMA centre or Sinkhorn-Knopp) and sharpened as DINO
  does; the student's heads get the teacher's prototype counts. Needs a SOURCE with a DINO head.
* ``features``: the student's CLS and patch tokens, each through a linear layer to the teacher's width,
  regress the teacher's tokens of the same view with a mean squared error (lightly-train's distillation: MSE
  between student and teacher features of the same image). The teacher's tokens are normalised per token over
  the channels (a layer norm without affine), so the target scale is the same for every teacher; its patch grid
  is resized bilinearly to the student's. Only the global crops take part (teacher and student must see the
  same view); the student's embedding is its backbone's, as for DINO.

The teacher runs once per step, under ``no_grad``, on all global crops together (``benchmarks/bench_distill.py``
measures its share of a step). Everything else is DINO's (``ssl_xcit.dino.module``): schedules, manual
optimisation, clipping, mixed precision, resume, checkpoints, the finite-loss check and the online k-NN, which
judges the student (``evaluated_network``). There is no EMA network.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.ibot import MaskedPatches
from ssl_xcit.dino.init_from import TIMM_PREFIX, read_source_file, timm_model, weights_from_checkpoint
from ssl_xcit.dino.koleo import koleo_loss
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.step import NUM_GLOBAL_CROPS, StepLosses
from ssl_xcit.errors import UserError

OBJECTIVES = ("dino", "features")
_OPTION = "--model.teacher"


# ------------------------------------------------------------------------------------------------- teacher
def head_from_state(state: Mapping[str, Tensor]) -> DINOHead:
    """A :class:`DINOHead` of the shape ``state`` (a DINO head's state dict) has, loaded with it."""
    if "mlp.weight" in state:
        linears = [state["mlp.weight"]]
    else:
        index = sorted(
            int(m.group(1))
            for k in state
            if (m := re.fullmatch(r"mlp\.(\d+)\.weight", k)) and state[k].ndim == 2
        )
        linears = [state[f"mlp.{i}.weight"] for i in index]
    if not linears or "last_layer.weight_v" not in state:
        raise UserError(f"not a DINO head state (keys {sorted(state)[:6]})")
    head = DINOHead(
        in_dim=linears[0].shape[1],
        out_dim=state["last_layer.weight_v"].shape[0],
        use_bn=any(k.endswith("running_mean") for k in state),
        nlayers=len(linears),
        hidden_dim=linears[0].shape[0],
        bottleneck_dim=linears[-1].shape[0],
    )
    head.load_state_dict(dict(state), strict=True)
    return head


class FrozenTeacher(nn.Module):
    """The frozen teacher: a backbone (ours or timm's), the DINO and patch heads where SOURCE has them.

    ``tokens(x)`` gives the final-norm CLS embedding (B, C) and the patch tokens on their grid (B, h, w, C').
    It stays in eval mode (``train()`` is refused silently) and its parameters never require gradients."""

    def __init__(
        self,
        backbone: nn.Module,
        label: str,
        head: nn.Module | None = None,
        patch_head: nn.Module | None = None,
        probe_size: int = 224,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.label = label
        self.head = head
        self.patch_head = patch_head
        self.is_ours = hasattr(backbone, "forward_cls_patches")
        for p in self.parameters():
            p.requires_grad_(False)
        self.train(False)
        with torch.no_grad():  # one probe: does it give tokens, and of which widths
            cls, patches = self.tokens(torch.zeros(1, 3, probe_size, probe_size))
        self.cls_dim, self.patch_dim = int(cls.shape[-1]), int(patches.shape[-1])

    def train(self, mode: bool = True) -> FrozenTeacher:
        return super().train(False)

    def tokens(self, x: Tensor) -> tuple[Tensor, Tensor]:
        height, width = x.shape[-2:]
        if self.is_ours:
            cls, patches = self.backbone.forward_cls_patches(x)
            grid = self.backbone.token_grid(height, width)
        else:
            out = self.backbone.forward_features(x)
            if not isinstance(out, Tensor) or out.ndim != 3:
                shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise UserError(
                    f"{_OPTION} {self.label}: its forward_features gives {shape}, not tokens (B, 1 + N, C): "
                    "the teacher needs a CLS token and patch tokens (a ViT-like model)"
                )
            prefix = int(getattr(self.backbone, "num_prefix_tokens", 1))
            cls, patches = out[:, 0], out[:, prefix:]
            count = patches.shape[1]
            rows = round(math.sqrt(count * height / width)) if count else 0
            grid = (rows, count // rows) if rows and count % rows == 0 else (0, 0)
        if grid[0] * grid[1] != patches.shape[1] or not patches.shape[1]:
            raise UserError(
                f"{_OPTION} {self.label}: its {patches.shape[1]} patch tokens of a {height}x{width} input do not "
                "form a patch grid; the teacher needs a CLS token and one token per patch"
            )
        return cls, patches.reshape(patches.shape[0], grid[0], grid[1], patches.shape[-1])


def _timm_teacher(spec: str) -> nn.Module:
    """timm's model for ``timm:NAME[@FILE]``, headless; ViTs take any input size (``dynamic_img_size``)."""
    try:
        return timm_model(spec, _OPTION, num_classes=0, dynamic_img_size=True)
    except TypeError:  # a family without the option (XCiT takes any size anyway)
        return timm_model(spec, _OPTION, num_classes=0)


def read_teacher(source: str | None) -> FrozenTeacher:
    """The frozen teacher of SOURCE (see the module docstring); one-line ``UserError`` for a bad source."""
    from ssl_xcit.models.checkpoint import backbone_from_checkpoint

    source = "" if source is None else str(source).strip()
    if not source:
        raise UserError(f"{_OPTION} is required: a .ckpt, .safetensors or .pth, or timm:NAME[@FILE]")
    if source.startswith(TIMM_PREFIX):
        model = _timm_teacher(source[len(TIMM_PREFIX) :])
        size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224, 224))[-1]
        return FrozenTeacher(model, source, probe_size=int(size))
    checkpoint = read_source_file(source, _OPTION)  # a one-line error for a missing or unreadable file
    weights = weights_from_checkpoint(checkpoint, source)
    try:
        backbone = backbone_from_checkpoint(checkpoint, source)  # the file is read once, however large
    except UserError as error:
        raise UserError(f"{_OPTION} {source}: {error}") from error
    heads = {
        part: head_from_state(weights.teacher[part])
        for part in ("head", "patch_head")
        if part in weights.teacher
    }
    return FrozenTeacher(backbone, source, probe_size=4 * backbone.size_multiple, **heads)


# ------------------------------------------------------------------------------------------------ features
class FeatureProjection(nn.Module):
    """The student's linear maps to the teacher's widths: CLS embedding and patch tokens."""

    def __init__(self, cls_in: int, patch_in: int, cls_out: int, patch_out: int) -> None:
        super().__init__()
        self.cls_proj = nn.Linear(cls_in, cls_out)
        self.patch_proj = nn.Linear(patch_in, patch_out)


def normalise_tokens(tokens: Tensor) -> Tensor:
    """Each token standardised over its channels (a layer norm without affine), in float32."""
    return F.layer_norm(tokens.float(), tokens.shape[-1:])


def align_grid(patches: Tensor, grid: tuple[int, int]) -> Tensor:
    """Patch tokens (B, h, w, C) resized bilinearly to ``grid`` (B, h', w', C); unchanged when equal."""
    if tuple(patches.shape[1:3]) == tuple(grid):
        return patches
    moved = F.interpolate(patches.permute(0, 3, 1, 2), size=grid, mode="bilinear", align_corners=False)
    return moved.permute(0, 2, 3, 1)


def features_loss(
    student_cls: Tensor, student_patches: Tensor, teacher_cls: Tensor, teacher_patches: Tensor
) -> tuple[Tensor, Tensor]:
    """(CLS term, patch term): mean squared errors of the projected student CLS (B, C) and patches (B, N, C)
    against the normalised teacher CLS and patches of the same shapes."""
    cls = F.mse_loss(student_cls.float(), normalise_tokens(teacher_cls))
    patch = F.mse_loss(student_patches.float(), normalise_tokens(teacher_patches))
    return cls, patch


# ---------------------------------------------------------------------------------------------- the module
class Distill(DINO):
    """A student trained against a frozen teacher (see the module docstring).

    Args:
        teacher: SOURCE of the teacher: a ``.ckpt``, ``.safetensors`` or ``.pth`` of ours, an official DINO
            file, or ``timm:NAME[@FILE]``.
        objective: ``dino`` (DINOv2's distillation against the teacher's head) or ``features`` (token
            regression).
        teacher_resolution: side of the square input the teacher sees; the global crops are resized to it
            (None: the global crop size, no resize).
        cls_weight, patch_weight: weights of the CLS and patch terms of the ``features`` objective.
        **kwargs: DINO's settings (student backbone, optimisation, schedules; ``out_dim`` and ``ibot_out_dim``
            come from the teacher's heads under ``dino``).
    """

    evaluated_network = "student"  # the online k-NN judges the student

    def __init__(
        self,
        teacher: str | None = None,
        objective: Literal["dino", "features"] = "features",
        teacher_resolution: int | None = None,
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
            frozen = read_teacher(teacher)
        ibot = float(kwargs.get("ibot_loss_weight", 0.0)) > 0
        if objective == "dino":
            if frozen.head is None:
                raise UserError(
                    f"{_OPTION} {teacher} has no DINO head, which the dino objective distils from: use "
                    "--model.objective features, or a checkpoint of ours or an official full DINO checkpoint"
                )
            if ibot and frozen.patch_head is None:
                raise UserError(
                    f"{_OPTION} {teacher} has no iBOT patch head, which iBOT's term distils from: set "
                    "ibot_loss_weight 0 or use a teacher trained with iBOT and a separate patch head"
                )
            kwargs["out_dim"] = frozen.head.last_layer.weight_v.shape[0]
            if ibot:
                kwargs.update(
                    ibot_out_dim=frozen.patch_head.last_layer.weight_v.shape[0], ibot_separate_head=True
                )
        elif ibot:
            raise UserError(
                "ibot_loss_weight > 0 needs --model.objective dino (the features objective has no iBOT term)"
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
        rank_zero_info(
            f"distillation ({objective}) from {teacher}: teacher widths {frozen.cls_dim} (CLS) / "
            f"{frozen.patch_dim} (patches)"
            + (f", {kwargs['out_dim']} prototypes" if objective == "dino" else "")
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

    def configure_model(self) -> None:
        from ssl_xcit.dino.fsdp import is_fsdp2, shard_module
        from ssl_xcit.dino.syncbn import convert_sync_batchnorm, has_batchnorms

        world_size = self.trainer.world_size
        if self.hparams.sync_batchnorm and world_size > 1 and has_batchnorms(self.student):
            self.student = convert_sync_batchnorm(self.student)
        if is_fsdp2(self.trainer):
            shard_module(self, self.trainer.strategy.data_parallel_mesh, str(self.trainer.precision))
        if self.hparams.compile and not self._compiled:
            self.student.compile_backbone()
            self.teacher.backbone.compile(dynamic=False)
            self._compiled = True

    def configure_callbacks(self) -> list:
        # The collapse guard watches a teacher distribution, which the features objective has not.
        return super().configure_callbacks() if self.hparams.objective == "dino" else []

    def on_fit_start(self) -> None:
        pass  # no init_from: the student starts fresh, the teacher was read at construction

    def _update_teacher(self, momentum: float) -> None:
        pass  # frozen: no EMA

    def forward(self, x: Tensor) -> Tensor:
        """The student backbone's embedding (the distilled network)."""
        return self.student.backbone(x)

    # --------------------------------------------------------------------------------------- the step
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
        self, crops: list[Tensor], masks: MaskedPatches | None, epoch: int, update_center: bool
    ) -> StepLosses:
        batch_size = crops[0].shape[0]
        sizes = {tuple(c.shape[-2:]) for c in crops[:NUM_GLOBAL_CROPS]}
        if len(sizes) != 1:
            raise ValueError(
                f"distillation needs {NUM_GLOBAL_CROPS} global crops of one size, got {sorted(sizes)}"
            )
        global_crops = torch.cat(crops[:NUM_GLOBAL_CROPS])
        teacher_cls, teacher_patches = self.teacher_tokens(global_crops)
        if self.hparams.objective == "features":
            return self._features_losses(global_crops, teacher_cls, teacher_patches, batch_size)
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
            student_output, embedding, student_tokens = self.student.forward_with_patches(
                crops, masks.masks, n_global=NUM_GLOBAL_CROPS
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
