"""Visualisation of what a backbone attends to."""

from ssl_xcit.visualize.attention import attention_heatmaps, overlay

__all__ = ["attention_heatmaps", "overlay"]
