"""The run around DINO's step: callbacks (k-NN monitor, collapse guard, progress bar, pre-emption, SIGTERM
broadcast), checkpointing, step checks, synced BatchNorm and the fit lifecycle; the objective is in ssl_xcit.dino.

Where things are: ssl_xcit.data (data) -> ssl_xcit.models (backbones) -> ssl_xcit.dino (objective: head, losses,
iBOT, KoLeo, Gram, masking, multi-crop, schedules, optimiser and window step, precision numerics, the module,
distillation, init_from) -> ssl_xcit.trainer (this package: run machinery) -> ssl_xcit.evaluation.
"""
