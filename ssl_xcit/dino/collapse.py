"""The old home of the collapse guard, kept because saved run configs (``trainer.callbacks``) from before the
``ssl_xcit.trainer`` package name ``ssl_xcit.dino.collapse.CollapseGuard``. New code imports
``ssl_xcit.trainer.collapse``; importing this module warns."""

import warnings

from ssl_xcit.trainer.collapse import CollapseGuard

__all__ = ["CollapseGuard"]

warnings.warn(
    "ssl_xcit.dino.collapse is deprecated: the class is ssl_xcit.trainer.collapse.CollapseGuard",
    DeprecationWarning,
    stacklevel=2,
)
