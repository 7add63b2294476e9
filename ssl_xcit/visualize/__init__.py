"""Pictures of backbones and runs, one module per kind (used by ``ssl-xcit visualize`` and the notebooks):
``attention``, ``pca``, ``neighbours``, ``retrieval``, ``curves``; ``common`` holds image reading and the HTML page.
"""

from ssl_xcit.visualize.attention import attention_heatmaps, overlay
from ssl_xcit.visualize.common import VisualizeError, html_page, read_image

__all__ = ["VisualizeError", "attention_heatmaps", "html_page", "overlay", "read_image"]
