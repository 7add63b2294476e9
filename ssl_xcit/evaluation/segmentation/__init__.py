"""Linear semantic segmentation probe on frozen patch tokens (DINOv2's dense protocol), ``ssl-xcit segment``.

Modules: :mod:`.data` (image/mask layouts, the whole-image transform), :mod:`.features` (dense tokens through
the feature cache), :mod:`.probe` (BatchNorm + linear head), :mod:`.metrics` (confusion-matrix mIoU),
:mod:`.run` (``run_segment``).
"""

from ssl_xcit.evaluation.segmentation.run import run_segment

__all__ = ["run_segment"]
