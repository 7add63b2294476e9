"""The old home of the progress bar, kept because recipes and saved run configs from before the
``ssl_xcit.trainer`` package name ``ssl_xcit.dino.progress.SyncedRichProgressBar``. New code imports
``ssl_xcit.trainer.progress``; importing this module warns."""

import warnings

from ssl_xcit.trainer.progress import SyncedRichProgressBar

__all__ = ["SyncedRichProgressBar"]

warnings.warn(
    "ssl_xcit.dino.progress is deprecated: the class is ssl_xcit.trainer.progress.SyncedRichProgressBar",
    DeprecationWarning,
    stacklevel=2,
)
