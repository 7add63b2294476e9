"""The run around DINO's step: callbacks (k-NN monitor, RankMe, progress bar, pre-emption, SIGTERM broadcast),
the recipes' checkpoint callbacks, the memory plan (which builds a DINO module to trace a step) and CUDA autocast.

Where things are (each package imports only those before it; tests/test_import_order.py): ssl_xcit.data (data)
-> ssl_xcit.models (backbones) -> ssl_xcit.evaluation / retrieval / visualize -> ssl_xcit.parallel (FSDP2 and
its checkpoints, meta-device start, synced BatchNorm, cross-rank step checks, checkpoint IO) -> ssl_xcit.dino
(objective: head, losses, iBOT, KoLeo, Gram, masking, multi-crop, schedules, optimiser and window step, precision
numerics, the module and its lifecycle hooks, the collapse guard, distillation, init_from) -> ssl_xcit.trainer
(this package: run machinery) -> ssl_xcit.cli. ``ssl_xcit.trainer.fsdp`` only re-exports ``FSDP2Strategy`` for
configs that name that path.
"""
