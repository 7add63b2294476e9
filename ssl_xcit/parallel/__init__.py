"""Parallel and sharded training machinery that knows nothing of the objective: FSDP2 (``fsdp``: the strategy,
sharding, sharded and whole-file checkpoints), the meta-device start (``meta_start``), synced BatchNorm
(``syncbn``), the cross-rank step checks (``step_checks``: host agreement, finite loss) and checkpoint IO
(``checkpoint_io``).

Its place in the import order (tests/test_import_order.py): it builds on ``errors``, ``utils`` and ``models``
and never imports ``ssl_xcit.dino``, ``ssl_xcit.trainer`` or ``ssl_xcit.cli``; the objective (``ssl_xcit.dino``)
and the run (``ssl_xcit.trainer``) import it. What a piece needs of a DINO module it is handed as arguments.
"""
