"""The old home of the online k-NN callback, kept because recipes and saved run configs of releases before the
``ssl_xcit.trainer`` package name ``ssl_xcit.dino.callbacks.OnlineKNN``. New code imports
``ssl_xcit.trainer.callbacks``."""

from ssl_xcit.trainer.callbacks import OnlineKNN

__all__ = ["OnlineKNN"]
