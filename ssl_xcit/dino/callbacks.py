"""The old home of the online k-NN callback, kept because recipes and saved run configs from before the
``ssl_xcit.trainer`` package name ``ssl_xcit.dino.callbacks.OnlineKNN``. New code imports
``ssl_xcit.trainer.callbacks``; importing this module warns."""

import warnings

from ssl_xcit.trainer.callbacks import OnlineKNN

__all__ = ["OnlineKNN"]

warnings.warn(
    "ssl_xcit.dino.callbacks is deprecated: the class is ssl_xcit.trainer.callbacks.OnlineKNN",
    DeprecationWarning,
    stacklevel=2,
)
