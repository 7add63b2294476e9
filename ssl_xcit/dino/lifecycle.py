"""The old home of DINO's run hooks, kept because saved run configs from before the ``ssl_xcit.trainer``
package name ``ssl_xcit.dino.lifecycle.DINOLifecycle``. New code imports ``ssl_xcit.trainer.lifecycle``;
importing this module warns."""

import warnings

from ssl_xcit.trainer.lifecycle import DINOLifecycle

__all__ = ["DINOLifecycle"]

warnings.warn(
    "ssl_xcit.dino.lifecycle is deprecated: the class is ssl_xcit.trainer.lifecycle.DINOLifecycle",
    DeprecationWarning,
    stacklevel=2,
)
