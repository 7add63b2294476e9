"""The FSDP2 strategy's previous class path, kept because docs and saved run configs (``trainer.strategy``) name
``ssl_xcit.trainer.fsdp.FSDP2Strategy``. The strategy lives in ``ssl_xcit.parallel.fsdp`` (importing it
registers ``--trainer.strategy fsdp2`` and ``fsdp2_whole``); new code imports it from there."""

from ssl_xcit.parallel.fsdp import FSDP2Strategy

__all__ = ["FSDP2Strategy"]
