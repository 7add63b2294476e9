"""The old home of the FSDP2 strategy, kept because saved run configs (``trainer.strategy``) of its branch
from before the ``ssl_xcit.trainer`` package name ``ssl_xcit.dino.fsdp.FSDP2Strategy``. New code imports
``ssl_xcit.trainer.fsdp``; importing this module warns."""

import warnings

from ssl_xcit.trainer.fsdp import FSDP2Strategy

__all__ = ["FSDP2Strategy"]

warnings.warn(
    "ssl_xcit.dino.fsdp is deprecated: the class is ssl_xcit.trainer.fsdp.FSDP2Strategy",
    DeprecationWarning,
    stacklevel=2,
)
