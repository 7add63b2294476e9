"""DINO's run around the step: train modes, compile and synced BN, schedules, the finite-loss reads, progress
and checkpoint hooks. ``DINO`` (``ssl_xcit.dino.module``) adds the networks, the losses and the step."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info

from ssl_xcit.dino.gram import adapt_checkpoint_state, read_gram_source
from ssl_xcit.dino.optim import build_optimizer, fused_by_default, get_params_groups
from ssl_xcit.dino.optimizer_step import scaler_in_use
from ssl_xcit.dino.precision import check_precision
from ssl_xcit.dino.schedules import configured_batch_size, dino_schedules
from ssl_xcit.parallel.checkpoint_io import AtomicCheckpointIO, last_checkpoint
from ssl_xcit.parallel.fsdp import is_fsdp2, shard_module
from ssl_xcit.parallel.meta_start import capture_targets, materialise
from ssl_xcit.parallel.step_checks import diverged, loss_scale_collapsed
from ssl_xcit.parallel.syncbn import convert_sync_batchnorm, has_batchnorms
from ssl_xcit.utils.rng import capture_rng_states, gather_rng_states, own_rng_states, restore_rng_states


def _floats(pair: tuple[Any, Any] | None) -> tuple[float, float] | None:
    return None if pair is None else (float(pair[0]), float(pair[1]))


class DINOLifecycle(LightningModule):
    """The Lightning hooks of a DINO run that are not the step (attributes are set by ``DINO.__init__``)."""

    # ----------------------------------------------------------------------------------------- mode, setup
    # `train()`/`eval()` are nn.Module's: `eval()` puts student and teacher in eval mode, so `forward` (the
    # exported network) uses BatchNorm running statistics, embeds each image independently of its batch and
    # never moves those statistics. Training puts them back itself (`_set_training_modes`): the student in train
    # mode, the teachers in `teacher_mode` (train by default: in the reference the teacher's BatchNorms use batch
    # statistics while training).

    def _set_training_modes(self) -> None:
        """Student in train mode, every submodule included; the EMA and Gram teachers in ``teacher_mode``: train
        (DINO's reference: XCiT's BatchNorms with batch statistics) or eval (DINOv3's ``SSLMetaArch.train``:
        targets without train-time augmentation such as RoPE's rescaled coordinates). Lightning 2.6 no longer
        calls ``.train()`` at fit start, so an earlier ``model.eval()`` (or ``teacher.backbone.eval()``) would
        otherwise train the student without drop path and give eval-mode BatchNorm targets for the whole run."""
        teacher_train = self.hparams.get("teacher_mode", "train") == "train"
        self.student.train(True)
        self.teacher.train(teacher_train)
        if getattr(self, "gram_teacher", None) is not None:
            self.gram_teacher.train(teacher_train)

    @property
    def gram_crops_scale(self) -> int | None:
        """The Gram teacher's crop side / the global crops' when the model anchors (None: it does not): the
        datamodule reads it at setup and cuts those crops into every batch (``ssl_xcit.dino.gram``)."""
        gram = getattr(self, "gram_teacher", None)
        return None if gram is None else gram.resolution_scale

    def on_fit_start(self) -> None:
        # After a resumed run's checkpoint is restored: --model.init_from loads into fresh runs only, and a
        # fixed Gram teacher is read only when the checkpoint does not already hold it.
        from ssl_xcit.dino.init_from import start_from_source

        start_from_source(self)
        read_gram_source(self)

    def on_train_start(self) -> None:
        self._set_training_modes()
        self._build_schedules()

    def on_train_epoch_start(self) -> None:
        # Callbacks (online k-NN, anything a user adds) may have switched modes at the previous epoch's end.
        self._set_training_modes()
        # A partial accumulation window must never leak into this epoch's first step.
        self.optimizers().zero_grad(set_to_none=True)
        self._window_backwards = 0

    def on_train_epoch_end(self) -> None:
        self._read_finite()

    def on_validation_model_train(self) -> None:
        super().on_validation_model_train()
        if self.trainer.state.fn == "fit":
            self._set_training_modes()

    def configure_model(self) -> None:
        # DINO.load_from_checkpoint calls this hook too, with no trainer: one process.
        world_size = self._trainer.world_size if self._trainer is not None else 1
        # Networks built on the meta device (ssl_xcit.parallel.meta_start) are materialised below.
        recipe = getattr(self, "_meta_recipe", None)
        targets = capture_targets(self) if recipe is not None else None
        if self.hparams.sync_batchnorm and world_size > 1 and has_batchnorms(self):
            self.student = convert_sync_batchnorm(self.student)
            self.teacher = convert_sync_batchnorm(self.teacher)
            if getattr(self, "gram_teacher", None) is not None:  # batch statistics in its forward too
                self.gram_teacher.backbone = convert_sync_batchnorm(self.gram_teacher.backbone)
        if is_fsdp2(self._trainer):
            shard_module(self, self.trainer.strategy.data_parallel_mesh, str(self.trainer.precision))
        if recipe is not None:  # each rank's shards (whole networks off FSDP2), filled as built whole
            device = self.trainer.strategy.root_device if is_fsdp2(self._trainer) else torch.device("cpu")
            materialise(self, recipe, targets, device)
            self._meta_recipe = None
        if self.hparams.compile and not self._compiled:
            self.student.compile_backbone()
            self.teacher.compile_backbone()
            self._compiled = True

    def setup(self, stage: str) -> None:
        if stage == "fit":  # bf16-true and 16-true freeze the teacher (``ssl_xcit.dino.precision``)
            check_precision(self.trainer.precision)
        # Every checkpoint goes through an atomic write, however the Trainer was configured.
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        strategy = self.trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()

    def configure_callbacks(self) -> list:
        from ssl_xcit.dino.collapse import CollapseGuard

        hp = self.hparams
        guard = CollapseGuard(hp.collapse_guard, hp.collapse_patience, hp.collapse_grace_steps)
        guard.read_every = hp.sync_every_n_steps
        return [guard]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        # DINOv3's lr multipliers per parameter (``layerwise_decay``, ``patch_embed_lr_mult``; 1: DINO's 2 groups)
        groups = get_params_groups(
            self.student, hp.get("layerwise_decay", 1.0), hp.get("patch_embed_lr_mult", 1.0)
        )
        fused = hp.fused_optimizer
        if (
            fused is None
        ):  # automatic: fused under a GradScaler (16-mixed), where it saves a host read per step
            fused = fused_by_default(
                hp.optimizer, groups, self._trainer is not None and scaler_in_use(self.trainer)
            )
        return build_optimizer(hp.optimizer, groups, fused=fused)

    def _build_schedules(self) -> None:
        if self.schedules is not None:
            return
        trainer, hp = self.trainer, self.hparams
        per_device = configured_batch_size(trainer.train_dataloader)
        s = self.schedules = dino_schedules(
            hp, trainer.max_epochs, trainer.num_training_batches, per_device, trainer.world_size
        )
        epochs, iters = trainer.max_epochs, s.iters_per_epoch
        rank_zero_info(
            f"DINO schedules: {epochs} epoch{'s' * (epochs != 1)} x {iters} step{'s' * (iters != 1)}, "
            f"total batch {s.total_batch} ({per_device}/device x {trainer.world_size} x "
            f"{hp.accumulate_grad_batches} accumulated), peak lr {s.peak_lr:.3g}"
        )

    def _read_finite(self) -> None:
        """The host's read of the finite-loss record (every rank at once): stop with the first bad step, or
        when 16-mixed's GradScaler has skipped steps until its scale collapsed."""
        self._steps_since_read = 0
        if self._trainer is None or not self._finite.pending:
            return
        found = self._finite.read(self.trainer.strategy.all_gather)
        if self._finite.last_loss is not None:
            self.progress_values["train/loss"] = self._finite.last_loss
        if found is not None:
            raise diverged(
                found, self.current_epoch, self.hparams.sync_every_n_steps, last_checkpoint(self.trainer)
            )
        if scaler_in_use(self.trainer):  # every rank reads its own scale; they decide on the smallest
            scale = torch.tensor(self.trainer.precision_plugin.scaler.get_scale(), device=self.device)
            smallest = float(self.trainer.strategy.all_gather(scale).min())
            error = loss_scale_collapsed(
                smallest, self.global_step, self._finite.last_loss, self.current_epoch,
                last_checkpoint(self.trainer),
            )  # fmt: skip
            if error is not None:
                raise error

    @property
    def trained_epoch(self) -> int:
        """The epoch the weights belong to: ``current_epoch`` while fitting; under ``validate``/``test`` the
        checkpoint's epoch (Lightning restores progress only for ``fit``), so the teacher temperature and the
        k-NN label match the end-of-fit numbers."""
        if self._restored_progress is not None and self.trainer.state.fn != "fit":
            return self._restored_progress[0]
        return self.current_epoch

    @property
    def trained_step(self) -> int:
        """The optimiser steps behind the weights (``global_step``, or the checkpoint's outside ``fit``)."""
        if self._restored_progress is not None and self.trainer.state.fn != "fit":
            return self._restored_progress[1]
        return self.global_step

    # The last step's collapse signals as floats, for callbacks and benchmarks: reading waits for the device.
    @property
    def last_collapse_signals(self) -> tuple[float, float] | None:
        return _floats(self.signal_tensors.get("dino"))

    @last_collapse_signals.setter
    def last_collapse_signals(self, value: tuple[Any, Any]) -> None:
        self.signal_tensors["dino"] = value

    @property
    def last_patch_collapse_signals(self) -> tuple[float, float] | None:
        return _floats(self.signal_tensors.get("ibot"))

    @last_patch_collapse_signals.setter
    def last_patch_collapse_signals(self, value: tuple[Any, Any]) -> None:
        self.signal_tensors["ibot"] = value

    # ------------------------------------------------------------------------------------- checkpointing
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint is written only after the finite record is read: none ever holds diverged weights.
        self._read_finite()
        # RNG states make a resumed run draw the same crops and drop-path masks as an uninterrupted one, on
        # every rank: each rank's own states, gathered (Lightning calls this hook on every rank).
        checkpoint["rng_states"] = capture_rng_states()
        per_rank = gather_rng_states(checkpoint["rng_states"])
        if per_rank is not None:
            checkpoint["rng_states_per_rank"] = per_rank
        if self.init_state is not None:  # a resumed run keeps its head-only warm-up, without reading SOURCE
            checkpoint["init_from"] = dict(self.init_state)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Restored at load time: a resumed fit creates its first data iterator before `on_train_start`, and
        # Lightning skips the sanity-check validation when restarting, so nothing draws in between.
        self._restored_progress = (int(checkpoint.get("epoch", 0)), int(checkpoint.get("global_step", 0)))
        trainer = self._trainer  # None under DINO.load_from_checkpoint
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        restore_rng_states(own_rng_states(checkpoint, rank, world_size))
        self.init_state = checkpoint.get("init_from")
        if "state_dict" in checkpoint:  # FSDP2's strategy adapted and loaded the weights before this hook
            self.adapt_state_dict(checkpoint["state_dict"])

    def adapt_state_dict(self, state: dict[str, Any]) -> None:
        """Make a checkpoint's weights fit this run's settings, in place: Gram anchoring switched on or off at
        resume (``ssl_xcit.dino.gram``). It only moves, drops and adds entries, never reads a value, so FSDP2's
        strategy can run it on stand-ins for the tensors of a sharded folder before reading any of them."""
        adapt_checkpoint_state(state, getattr(self, "gram_teacher", None))
