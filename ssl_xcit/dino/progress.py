"""The old home of the progress bar, kept because recipes and saved run configs of releases before the
``ssl_xcit.trainer`` package name ``ssl_xcit.dino.progress.SyncedRichProgressBar``. New code imports
``ssl_xcit.trainer.progress``."""

from ssl_xcit.trainer.progress import SyncedRichProgressBar

__all__ = ["SyncedRichProgressBar"]
