"""Linear probe on a frozen backbone, following DINO's ``eval_linear.py``, as a LightningModule.

Modules: :mod:`.data` (datamodule and transforms), :mod:`.probe` (the LightningModule), :mod:`.run` (the
``run_linear`` entry point, full and fast paths).

- The backbone is frozen: no gradients, and always in eval mode. Lightning 2.6 does not call ``model.train()``
  during fit (it only warns about eval-mode modules at fit start, and its evaluation loop restores each
  submodule's captured ``training`` flag), so the probe puts the backbone in eval mode at the start of every
  training epoch, and its ``train()`` override keeps it there when a user calls ``probe.train()``.
- The head is ``Linear(dim, num_classes)`` with weight ~ N(0, 0.01) and bias 0, on the CLS embedding; the
  feature can instead concatenate the CLS of the last n blocks and the average-pooled patch tokens.
- SGD, momentum 0.9, weight decay 0, lr = base_lr x total_batch / 256, cosine decay to 0 (per step here; DINO
  steps per epoch, which is the same curve sampled coarser).
- Train transform RandomResizedCrop + horizontal flip; validation uses the eval transform (resize, centre crop).
- ``lrs`` may list several base learning rates: one head per lr is trained on the same feature batches
  (DINOv2's sweep), which costs one backbone forward per batch in total, and the best head is reported.

``fast`` mode (``run_linear(..., fast=True)`` in :mod:`.run`) trains the heads on cached eval-transform features instead of
images: no augmentation, so usually slightly lower accuracy, but each epoch is a matmul and the features are
shared with the k-NN cache.
"""

from ssl_xcit.evaluation.linear.data import LinearProbeDataModule, linear_train_transform
from ssl_xcit.evaluation.linear.probe import DEFAULT_BASE_LR, DEFAULT_SWEEP_LRS, LinearProbe, write_results
from ssl_xcit.evaluation.linear.run import run_linear

__all__ = [
    "DEFAULT_BASE_LR",
    "DEFAULT_SWEEP_LRS",
    "LinearProbe",
    "LinearProbeDataModule",
    "linear_train_transform",
    "run_linear",
    "write_results",
]
