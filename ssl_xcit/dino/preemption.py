"""The old home of the pre-emption callback, kept because saved run configs (``ssl-xcit fit`` added it to
every run) from before the ``ssl_xcit.trainer`` package name
``ssl_xcit.dino.preemption.PreemptionCheckpoint``. New code imports ``ssl_xcit.trainer.preemption``; importing
this module warns."""

import warnings

from ssl_xcit.trainer.preemption import PreemptionCheckpoint

__all__ = ["PreemptionCheckpoint"]

warnings.warn(
    "ssl_xcit.dino.preemption is deprecated: the class is ssl_xcit.trainer.preemption.PreemptionCheckpoint",
    DeprecationWarning,
    stacklevel=2,
)
