"""The old home of the RankMe callback, kept because recipes and saved run configs of its branch from before
the ``ssl_xcit.trainer`` package name ``ssl_xcit.dino.rankme.RankMe``. New code imports
``ssl_xcit.trainer.rankme``; importing this module warns."""

import warnings

from ssl_xcit.trainer.rankme import RankMe

__all__ = ["RankMe"]

warnings.warn(
    "ssl_xcit.dino.rankme is deprecated: the class is ssl_xcit.trainer.rankme.RankMe",
    DeprecationWarning,
    stacklevel=2,
)
