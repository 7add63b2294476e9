"""``DINODataModule``'s hooks for ``augment_on="device"``: the per-batch generators, the transfer hook that
decodes, crops and augments on the device, and the run seed that checkpoints carry."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ssl_xcit.data.transfer import OTHER_STREAM, augment_batch, loop_position


class DeviceAugmentHooks:
    """Mixed into ``DINODataModule`` (which sets ``reader``, ``device_augment``, ``_augment_seed``,
    ``_other_batches`` and ``decode_fallbacks``); not usable alone."""

    def augment_seed(self) -> int:
        """The run's seed for the device augmentation: ``torch.initial_seed()`` at first use (Lightning's
        ``seed_everything``), or the one a loaded checkpoint recorded."""
        if self._augment_seed is None:
            self._augment_seed = int(torch.initial_seed())
        return self._augment_seed

    def batch_rng(self) -> np.random.Generator:
        """The generator of the batch being transferred, seeded by (run seed, rank, stream, epoch, batch): see
        ``ssl_xcit.data.transfer`` for why it is derived per batch."""
        trainer = self.trainer
        rank = trainer.global_rank if trainer is not None else 0
        key = loop_position(trainer)
        if key is None:
            key = (OTHER_STREAM, 0, self._other_batches)
            self._other_batches += 1
        return np.random.default_rng([self.augment_seed(), rank, *key])

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With ``augment_on="device"``: the decode, crops and photometric augmentation of a multi-crop batch, on
        its device (``ssl_xcit.data.transfer``)."""
        if self.device_augment is None:
            return batch
        batch, fallbacks = augment_batch(
            batch, self.reader, self.device_augment, self.batch_rng, self.trainer
        )
        self.decode_fallbacks += fallbacks
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"augment_seed": self.augment_seed()} if self.device_augment is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "augment_seed" in state_dict:
            self._augment_seed = int(state_dict["augment_seed"])
        # Checkpoints from before per-batch seeding hold "augment_rng", one generator state (rank 0's): it is
        # ignored, and the draws continue from this run's seed.
