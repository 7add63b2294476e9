"""DINOv3's Gram anchoring: the student's patch-to-patch similarities held to those of a frozen Gram teacher.

The loss (DINOv3's ``dinov3/loss/gram_loss.py`` with ``img_level: true``, ``tokens_used: all``): per image,
L2-normalise the N patch features of student and Gram teacher, form each N x N Gram matrix of cosine
similarities, and take the mean squared difference over every entry of every image. ``remove_negative`` sets
negative similarities of both matrices to 0 first (DINOv3's ``remove_neg``; its 7B run keeps them).

Which features (DINOv3's ``SSLMetaArch.get_gram_teacher_output``): the student's final-norm patch tokens of its
global crops from the DINO/iBOT pass itself (masked when iBOT masks them), and the Gram teacher's final-norm
patch tokens of its own crops (DINOv3's ``gram_teacher_crops`` with ``gram_teacher_no_distortions``): the loader
cuts, for each global crop, the same box with the same flip at ``resolution_scale`` x its side, with no
photometric distortion (``ssl_xcit.data.transforms`` on the CPU path, ``ssl_xcit.data.crops`` and
``ssl_xcit.data.device_crops`` on the device path); a batch carries them as ``{"crops": [...], "gram_crops":
[...]}`` (:func:`gram_crops_from_batch`). The Gram teacher's patch features are resized bicubically (no
antialias, ``align_corners=False``) to the student's patch grid.

Schedule (DINOv3's ``train.py`` and ``gram.loss_weight_schedule``): the weight is 0 before ``gram_start_step``,
then a half cosine from 0 to ``gram_loss_weight`` over ``gram_weight_warmup_steps`` steps (``schedules.gram_ramp``),
then constant. The Gram teacher is refreshed from the EMA teacher after iteration ``it`` (before step
``it + 1``) when ``(it + 1) % gram_refresh_every == 0`` and ``it + 1 > gram_start_step`` (DINOv3's
``it_first_update`` = ``gram_start_step + 1``), at most ``gram_max_refreshes`` times (:meth:`GramTeacher.update`).

Memory: one N x N float32 matrix per image grows as the square of the token count (XCiT/8 at 448 px: N = 3,136,
39 MB an image). Images are taken in chunks of at most :data:`CHUNK_BYTES` of Gram matrix each; with more than
one chunk every chunk is checkpointed (recomputed in the backward), so no N x N tensor of the whole batch is
ever alive (``benchmarks/bench_gram.py``; docs/ibot.md, "Gram anchoring").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.checkpoint import checkpoint

from ssl_xcit.data.crops import gram_crop_side
from ssl_xcit.errors import UserError
from ssl_xcit.models.base import PATCH_TOKEN_FAMILIES
from ssl_xcit.parallel.fsdp import load_whole_state, local_tensors, reshard

# Gram-matrix bytes per chunk of images (float32). Below it a batch is one chunk (no recomputation); above it
# the peak of the term is a few chunks, whatever the batch.
CHUNK_BYTES = 128 * 2**20
NUM_GRAM_CROPS = 2  # one per global crop
# ``gram_teacher: init_from``: the run's own init_from SOURCE, i.e. the model it continues from (DINOv3 anchors a
# continued run's dense features to where they came from).
INIT_FROM = "init_from"


def _chunk_sum(student: torch.Tensor, teacher: torch.Tensor, remove_negative: bool) -> torch.Tensor:
    """Sum over images and entries of (Gram(student) - Gram(teacher))**2 for unit rows (c, N, D), float32."""
    student_sim = torch.matmul(student, student.transpose(-1, -2))
    with torch.no_grad():
        teacher_sim = torch.matmul(teacher, teacher.transpose(-1, -2))
        if remove_negative:
            teacher_sim = teacher_sim.clamp_min(0.0)
    if remove_negative:  # DINOv3 zeroes them in place: the same value and a zero gradient there
        student_sim = student_sim.clamp_min(0.0)
    return (student_sim - teacher_sim).square().sum()


def gram_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    remove_negative: bool = False,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Mean over images b and patch pairs (i, j) of (cos(s_bi, s_bj) - cos(t_bi, t_bj))**2, in float32.

    ``student`` (B, N, D) carries the gradient; ``teacher`` (B, N, D') is a target (D' may differ from D: only
    the N x N matrices meet). ``remove_negative``: negative similarities count as 0 on both sides.
    ``chunk_bytes``: Gram-matrix bytes per chunk of images (None: :data:`CHUNK_BYTES`)."""
    if student.ndim != 3 or teacher.shape[:2] != student.shape[:2]:
        raise ValueError(
            f"the Gram loss needs student and teacher patch features (B, N, D) with the same B and N, got "
            f"{tuple(student.shape)} and {tuple(teacher.shape)}"
        )
    n_images, n_tokens = student.shape[:2]
    with torch.autocast(student.device.type, enabled=False):
        student = F.normalize(student.float(), dim=-1)
        teacher = F.normalize(teacher.detach().float(), dim=-1)
        per_chunk = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * n_tokens * n_tokens))
        if per_chunk >= n_images:
            total = _chunk_sum(student, teacher, remove_negative)
        else:
            # Chunk sums in float32 (each up to per_chunk * N^2 terms, as the unchunked sum), one chunk's
            # matrices alive at a time in the forward and again in the backward.
            total = sum(
                checkpoint(_chunk_sum, s, t, remove_negative, use_reentrant=False, preserve_rng_state=False)
                for s, t in zip(student.split(per_chunk), teacher.split(per_chunk), strict=True)
            )
        return total / (n_images * n_tokens * n_tokens)


def resize_patches(tokens: torch.Tensor, grid: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """Patch features (B, h*w, D) on ``grid`` (h, w) resized bicubically to ``size`` (h', w'), as DINOv3 resizes
    its Gram teacher's (no antialias, ``align_corners=False``); float32 out."""
    if tuple(grid) == tuple(size):
        return tokens.float()
    maps = tokens.float().transpose(1, 2).unflatten(-1, tuple(grid))  # (B, D, h, w)
    maps = F.interpolate(maps, size=tuple(size), mode="bicubic", align_corners=False, antialias=False)
    return maps.flatten(-2).transpose(1, 2)


def check_gram_settings(hp: Mapping[str, Any], backbone: nn.Module) -> None:
    """A UserError naming the first Gram setting of DINO's hyperparameters ``hp`` that cannot work with
    ``backbone`` (the student's)."""
    weight = hp.get("gram_loss_weight", 0.0)
    if not weight >= 0:
        raise UserError(f"gram_loss_weight must be >= 0 (0 disables Gram anchoring), got {weight!r}")
    for name in ("gram_start_step", "gram_weight_warmup_steps", "gram_refresh_every", "gram_max_refreshes"):
        value = hp.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{name} must be an integer >= 0, got {value!r}")
    scale = hp.get("gram_resolution_scale", 1)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 1 <= scale <= 2:
        raise UserError(
            f"gram_resolution_scale must be a number from 1 to 2 (the Gram teacher's crop side / the student's; "
            f"DINOv3: 2, and 1.5 in its high-resolution stage), got {scale!r}"
        )
    source = hp.get("gram_teacher")
    # The source itself is read when a fresh fit starts (read_gram_source): a checkpoint of a run that holds
    # its Gram teacher loads wherever the file has gone.
    if source is not None and (not isinstance(source, (str, os.PathLike)) or not str(source).strip()):
        raise UserError(
            f"gram_teacher must be a SOURCE as --model.init_from takes (a .ckpt, .safetensors or .pth, or "
            f"timm:NAME[@FILE]) or null for a snapshot of the EMA teacher at gram_start_step, got {source!r}"
        )
    if source == INIT_FROM and not hp.get("init_from"):
        raise UserError(
            "gram_teacher: init_from anchors to --model.init_from's SOURCE, but init_from is not set; set it, or "
            "name the Gram teacher's SOURCE itself"
        )
    gives = getattr(backbone, "supports_masking", False) or getattr(backbone, "gives_patch_tokens", False)
    if weight > 0 and not gives:
        raise UserError(
            f"Gram anchoring needs the final-norm patch tokens of the student's own pass, which "
            f"{getattr(backbone, 'family', '?')} backbones ({getattr(backbone, 'name', '?')}) do not give; it works "
            f"with the {', '.join(PATCH_TOKEN_FAMILIES)} families (or set gram_loss_weight: 0)"
        )


class GramTeacher(nn.Module):
    """The frozen Gram teacher (a backbone like the EMA teacher's, without its head or mask token) and its
    schedule.

    Its weights ride the module's state dict (``gram_teacher.backbone.*``); whether it holds a teacher yet and
    how many refreshes it has had ride it too (``gram_teacher._extra_state``, a CPU tensor, so checkpoint
    readers that expect tensors keep working): a resumed run holds the same Gram teacher and refresh count.

    Args:
        backbone: a backbone of the teacher's architecture (without drop path), made like the teacher's.
        teacher_backbone: the EMA teacher's backbone, which the Gram teacher is taken from.
        weight: the term's weight from ``start_step`` on.
        start_step: the optimiser step from which the term counts; with no ``source``, the EMA teacher of that
            step is snapshotted before the step's forward.
        refresh_every: the Gram teacher is replaced by the EMA teacher before every step that is a multiple of
            this after ``start_step`` (0 = never; DINOv3's rule, :meth:`refreshes_due`).
        max_refreshes: at most this many replacements.
        source: any SOURCE ``--model.init_from`` reads, loaded by :func:`read_gram_source` when a fit starts
            (then ``initialised``), or None for the snapshot.
        resolution_scale: the Gram teacher's crop side / the global crop's (1 to 2; the loader cuts them).
        remove_negative: negative similarities count as 0 (DINOv3's ``remove_neg``).
    """

    def __init__(
        self,
        backbone: nn.Module,
        teacher_backbone: nn.Module,
        weight: float,
        start_step: int = 0,
        refresh_every: int = 0,
        max_refreshes: int = 3,
        source: str | os.PathLike | None = None,
        resolution_scale: float = 1,
        remove_negative: bool = False,
    ) -> None:
        super().__init__()
        backbone.requires_grad_(False)
        for module in backbone.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = 0.0  # batch statistics in the forward, running statistics left as taken
        self.backbone = backbone.train(True)
        self._copy_from(teacher_backbone)  # defined weights until the first Gram teacher is taken
        self.weight = float(weight)
        self.start_step, self.refresh_every, self.max_refreshes = start_step, refresh_every, max_refreshes
        self.source = None if source is None else str(source)
        scale = float(resolution_scale)
        self.resolution_scale = int(scale) if scale.is_integer() else scale  # 1, 1.5, 2, as given
        self.remove_negative = bool(remove_negative)
        self.initialised = False  # host facts: no device read decides anything
        self.eval_mode = False  # teacher_mode eval (DINOv3's): the backbone in eval mode, whatever the tree's
        self.refreshes = 0

    def train(self, mode: bool = True) -> GramTeacher:
        """The Gram teacher computes its features as the EMA teacher does while training: in train mode, its
        BatchNorms (XCiT's stem and LPI) with batch statistics, whatever mode the module tree is put in, so
        training and validation see the same term. It has no drop path; its BatchNorms' momentum is 0, so
        their running statistics stay those of the teacher it was taken from. With ``eval_mode`` (the model's
        ``teacher_mode: eval``, DINOv3's: its Gram teacher runs in eval mode) the backbone is in eval mode instead,
        in training and validation alike."""
        super().train(mode)
        self.backbone.train(not getattr(self, "eval_mode", False))
        return self

    # -------------------------------------------------------------------------------------- schedule
    def weight_at(self, step: int) -> float:
        """The term's weight at optimiser ``step`` (0 before ``start_step`` or before a Gram teacher is held)."""
        return self.weight if step >= self.start_step and self.initialised else 0.0

    def refreshes_due(self, step: int) -> int:
        """Refreshes due before ``step``'s forward by DINOv3's rule: one after each iteration ``it`` with
        ``(it + 1) % refresh_every == 0`` and ``it + 1 > start_step``, i.e. one per multiple of ``refresh_every``
        in ``(start_step, step]``, at most ``max_refreshes``."""
        if self.refresh_every <= 0:
            return 0
        due = step // self.refresh_every - self.start_step // self.refresh_every
        return min(self.max_refreshes, max(0, due))

    @torch.no_grad()
    def update(self, teacher_backbone: nn.Module, step: int) -> None:
        """Before ``step``'s forward: take the first Gram teacher (the EMA teacher's snapshot; a ``source`` was
        read at fit start) once ``step`` reaches ``start_step``, then replace it by the EMA teacher whenever
        :meth:`refreshes_due` rises. Refreshes due before the first Gram teacher was taken (a run that switched
        the term on when it resumed) count as spent, as DINOv3 counts them when it resumes. Idempotent for the
        micro-batches of one step. Host arithmetic and device copies only: nothing waits."""
        if step < self.start_step:
            return
        if not self.initialised:
            if self.source is not None:  # read_gram_source runs at fit start; never silently the EMA teacher
                raise RuntimeError(
                    "the Gram teacher's source was not read before training (read_gram_source)"
                )
            self._copy_from(teacher_backbone)
            self.initialised = True
            self.refreshes = self.refreshes_due(step)
            return
        if self.refreshes < self.refreshes_due(step):
            self._copy_from(teacher_backbone)
            self.refreshes = self.refreshes_due(step)

    def _copy_from(self, teacher_backbone: nn.Module) -> None:
        # Parameters and every buffer, the non-persistent ones too; under FSDP2 shard by shard (both are
        # sharded alike: ssl_xcit.parallel.fsdp).
        reshard(teacher_backbone)
        source = {**dict(teacher_backbone.named_parameters()), **dict(teacher_backbone.named_buffers())}
        own = {**dict(self.backbone.named_parameters()), **dict(self.backbone.named_buffers())}
        targets = [t.data for t in local_tensors(own.values())]
        torch._foreach_copy_(targets, [t.detach() for t in local_tensors(source[k] for k in own)])

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([int(self.initialised), self.refreshes], dtype=torch.int64)

    def set_extra_state(self, state: Any) -> None:
        values = torch.as_tensor(state, device="cpu").tolist()  # saved on the host, loaded to the host
        self.initialised, self.refreshes = bool(values[0]), int(values[1])

    # ------------------------------------------------------------------------------------------ loss
    def loss(
        self, gram_crops: torch.Tensor, student_patches: torch.Tensor, grid: tuple[int, int]
    ) -> torch.Tensor:
        """The Gram loss of the student's patch tokens (G*B, N, C) on its patch ``grid`` against the Gram
        teacher's of its own crops ``gram_crops`` (G*B, 3, s*H, s*W), resized to that grid."""
        with torch.no_grad():
            _, tokens = self.backbone.forward_cls_patches(gram_crops)
            teacher = resize_patches(tokens, self.backbone.token_grid(*gram_crops.shape[-2:]), grid)
        return gram_loss(student_patches, teacher, self.remove_negative)


def build_gram_teacher(hp: Mapping[str, Any], student: nn.Module, teacher: nn.Module) -> GramTeacher | None:
    """The Gram teacher DINO's hyperparameters ``hp`` ask for (None when ``gram_loss_weight`` is 0), after
    checking them against the student's backbone."""
    check_gram_settings(hp, student.backbone)
    if not hp.get("gram_loss_weight", 0.0) > 0:
        return None
    from ssl_xcit.models import create_model

    # Built anew rather than deep-copied: no iBOT mask token, and its tensors are made as the teacher's were
    # (fake tensors included). Its initial weights are overwritten; the forked RNG keeps the run's stream as
    # it is without the term.
    with torch.random.fork_rng(devices=[]):
        backbone = create_model(hp["backbone"], drop_path_rate=0.0, **dict(hp.get("backbone_kwargs") or {}))
    return GramTeacher(
        backbone,
        teacher.backbone,
        hp["gram_loss_weight"],
        start_step=hp["gram_start_step"],
        refresh_every=hp["gram_refresh_every"],
        max_refreshes=hp["gram_max_refreshes"],
        source=hp["gram_teacher"],
        resolution_scale=hp["gram_resolution_scale"],
        remove_negative=hp["gram_remove_negative"],
    )


def gram_weight(gram: GramTeacher | None, schedules: Any, step: int) -> float:
    """The Gram term's weight at ``step``: the precomputed ramp (``schedules``) while fitting, the full weight
    from ``gram_start_step`` outside a fit (as the iBOT weight); 0 without a Gram teacher held."""
    if gram is None or not gram.initialised:
        return 0.0
    return gram.weight_at(step) if schedules is None else schedules.gram_weight_at(step)


def read_gram_source(module: Any) -> None:
    """``on_fit_start``: read the fixed Gram teacher (``gram_teacher``, any SOURCE ``--model.init_from`` reads:
    its teacher backbone) into a run whose checkpoint does not hold it yet: a fresh run, or one resumed with the
    term newly switched on. A one-line UserError names a SOURCE that does not fit the model's architecture."""
    from torch.distributed.tensor import DTensor

    from ssl_xcit.dino.init_from import (
        _describe,
        fitted_backbone_state,
        source_backbone_state,
        weights_from_checkpoint,
    )
    from ssl_xcit.dino.mapped_source import read_mapped_checkpoint

    gram = module.gram_teacher
    if gram is None or gram.source is None or gram.initialised:
        return
    source = str(module.hparams.init_from if gram.source == INIT_FROM else gram.source)
    # Sharded (FSDP2): a one-file SOURCE is read memory-mapped, so each rank reads only its own slices.
    sharded = any(isinstance(p, DTensor) for p in gram.backbone.parameters())
    mapped = read_mapped_checkpoint(source) if sharded else None
    if mapped is not None:
        state = fitted_backbone_state(
            weights_from_checkpoint(mapped, source).teacher["backbone"], gram.backbone,
            "Gram teacher backbone", _describe(module.hparams), f"--model.gram_teacher {source}",
        )  # fmt: skip
    else:
        state = source_backbone_state(
            source, gram.backbone, module.hparams, "--model.gram_teacher", "Gram teacher backbone"
        )
    with torch.no_grad():
        load_whole_state(gram.backbone, state, strict=True)
    gram.initialised = True
    gram.refreshes = gram.refreshes_due(int(module.global_step))  # a resumed run's past ones count as spent
    rank_zero_info(f"gram_teacher {source}: loaded its teacher backbone")


def adapt_checkpoint_state(state: dict[str, torch.Tensor], gram_teacher: GramTeacher | None) -> None:
    """Make a checkpoint's ``state`` dict fit a module with or without Gram anchoring, in place, so that a run
    can switch the term on when it resumes (DINOv3 switches it on late in a run) or off. Switched on: the Gram
    teacher's keys are filled from the checkpoint's EMA teacher, with no Gram teacher taken yet (the snapshot
    comes at ``gram_start_step``). Switched off: its keys are dropped."""
    prefix = "gram_teacher."
    if gram_teacher is None:
        for key in [k for k in state if k.startswith(prefix)]:
            del state[key]
        return
    if any(k.startswith(prefix) for k in state):
        return
    for key, value in gram_teacher.state_dict().items():
        source = "teacher.backbone." + key.removeprefix("backbone.")
        state[prefix + key] = state[source] if source in state else value
    state[prefix + "_extra_state"] = torch.tensor([0, 0], dtype=torch.int64)


def gram_crops_from_batch(batch: Any) -> list[torch.Tensor] | None:
    """The Gram teacher's crops of a batch ``[{"crops": ..., "gram_crops": [...]}, labels, indices]`` (the
    datamodule's when the model anchors), or None."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return first.get("gram_crops") if isinstance(first, Mapping) else None


def check_gram_crops(model: Any, crops: list[torch.Tensor], gram_crops: list[torch.Tensor] | None) -> None:
    """A one-line UserError when the batch's Gram teacher crops (a list of (B, 3, s*H, s*W), or None) are not
    what the model needs: none for a model that does not anchor. Shapes only: nothing waits."""
    gram = getattr(model, "gram_teacher", None)
    if gram is None:
        if gram_crops is not None:
            raise UserError(
                "the batch carries the Gram teacher's crops but the model does not anchor (gram_loss_weight 0): "
                "set --model.gram_loss_weight, or let the datamodule read the model (it does at setup)"
            )
        return
    b, c, h, w = crops[0].shape
    want = (b, c, gram_crop_side(h, gram.resolution_scale), gram_crop_side(w, gram.resolution_scale))
    got = [tuple(t.shape) for t in gram_crops] if gram_crops is not None else None
    if got != [want] * NUM_GRAM_CROPS:
        raise UserError(
            f"Gram anchoring needs {NUM_GRAM_CROPS} Gram teacher crops of shape {want} (gram_resolution_scale "
            f"{gram.resolution_scale} x the global crops) in each batch, got {got or 'none'}; train with "
            "ssl_xcit.data.DINODataModule, which cuts them for a model that anchors"
        )


def gram_term(
    model: Any,
    gram_crops: list[torch.Tensor] | None,
    student_patches: torch.Tensor | None,
    global_side: tuple[int, int],
) -> torch.Tensor | None:
    """This step's Gram loss (a device tensor), or None when the term is off at this step. ``global_side``: the
    global crops' (H, W)."""
    if student_patches is None:
        return None
    grid = model.gram_teacher.backbone.token_grid(*global_side)
    return model.gram_teacher.loss(torch.cat(list(gram_crops)), student_patches, grid)
