"""Global (CLS) and local (patch-token) descriptors of retrieval images from a backbone (any family).

Local descriptors are the patch tokens after the last XCA block, before class attention
(``model.forward_patch_tokens``), as in XCiT appendix D.3: the class-attention blocks only update CLS, and the
final norm was trained on CLS alone. Per image the ``max_local`` tokens of largest L2 norm are kept (HOW's
"attention = activation norm" selection), which bounds memory: 1,000 tokens x 128-d x float16 = 256 KB/image.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ssl_xcit.retrieval.datasets import ImageList
from ssl_xcit.utils.modes import eval_mode

MULTISCALE = (1.0, 1 / math.sqrt(2), 0.5)


def _loader(images: ImageList, num_workers: int) -> torch.utils.data.DataLoader:
    # Batch size 1: retrieval images keep their aspect ratio, so sizes differ from image to image.
    return torch.utils.data.DataLoader(
        images, batch_size=None, shuffle=False, num_workers=num_workers, persistent_workers=False
    )


def _rescale(x: torch.Tensor, scale: float, patch_size: int) -> torch.Tensor:
    if scale == 1:
        return x
    h, w = (max(patch_size, round(s * scale / patch_size) * patch_size) for s in x.shape[-2:])
    return F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False, antialias=True)


def _progress(name: str, i: int, n: int, start: float, every: int = 100) -> None:
    if every and ((i + 1) % every == 0 or i + 1 == n):
        rate = (i + 1) / max(time.perf_counter() - start, 1e-9)
        print(f"  {name}: {i + 1}/{n} images ({rate:.2f} img/s)", flush=True)


def extract_global(
    model: nn.Module,
    images: ImageList,
    scales: Sequence[float] = (1.0,),
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    progress: str = "",
) -> torch.Tensor:
    """L2-normalised CLS embeddings (N, C); with several scales, the mean over rescaled inputs, then L2.

    ``scales`` (1, 1/sqrt2, 1/2) is DINO's ``multi_scale``: inputs are bilinearly resized (antialiased), each
    side rounded to a patch multiple. The model runs in eval mode on ``device`` and is handed back in its own
    modes, on its own device.
    """
    out = None
    start = time.perf_counter()
    # eval_mode outside inference mode: the caller's tensors it hands back must stay usable for training.
    with eval_mode(model, device), torch.inference_mode():
        for x, i in _loader(images, num_workers):
            x = x.unsqueeze(0).to(device)
            feat = sum(model(_rescale(x, s, images.patch_size)).float() for s in scales) / len(scales)
            if out is None:
                out = torch.empty(len(images), feat.shape[1])
            out[i] = F.normalize(feat[0], dim=0).cpu()
            _progress(progress, i, len(images), start) if progress else None
    return out


def select_local(tokens: torch.Tensor, max_local: int | None) -> torch.Tensor:
    """The ``max_local`` tokens (N, C) of largest L2 norm, by decreasing norm, then L2-normalised."""
    norms = tokens.norm(dim=-1)
    if max_local is not None and tokens.shape[0] > max_local:
        keep = norms.topk(max_local).indices
    else:
        keep = norms.argsort(descending=True)
    return F.normalize(tokens[keep].float(), dim=-1)


def extract_local(
    model: nn.Module,
    images: ImageList,
    max_local: int | None = 1000,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    dtype: torch.dtype = torch.float16,
    progress: str = "",
    tokens: str = "last_block",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local descriptors of every image, concatenated: ``(descriptors (sum n_i, d), counts (N,))``.

    Each image's patch tokens are capped to ``max_local`` by norm, L2-normalised, then passed through
    ``transform`` (the learnt PCA, which L2-normalises again) and stored as ``dtype`` (float16 by default:
    ROxford at 1,000 x 128-d is 1.3 GB instead of 2.6 GB). The model is handed back as in
    :func:`extract_global`. ``tokens``: ``last_block`` (``forward_patch_tokens``) or ``final_norm`` (the patch
    tokens of ``forward_cls_patches``; ``ssl_xcit.retrieval.config.LOCAL_TOKENS``).
    """
    per_image: list[torch.Tensor | None] = [None] * len(images)
    start = time.perf_counter()
    with eval_mode(model, device), torch.inference_mode():
        for x, i in _loader(images, num_workers):
            batch = x.unsqueeze(0).to(device)
            if tokens == "final_norm":
                patch = model.forward_cls_patches(batch)[1]
            else:
                patch = model.forward_patch_tokens(batch)[0]
            desc = select_local(patch[0], max_local)
            if transform is not None:
                desc = transform(desc.cpu())
            per_image[i] = desc.to("cpu", dtype)
            _progress(progress, i, len(images), start) if progress else None
    counts = torch.tensor([d.shape[0] for d in per_image], dtype=torch.long)
    return torch.cat(per_image), counts


def split_counts(descriptors: torch.Tensor, counts: torch.Tensor, chunk_images: int):
    """Yield ``(descriptors, counts)`` chunks of at most ``chunk_images`` consecutive images."""
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    for start in range(0, len(counts), chunk_images):
        stop = min(start + chunk_images, len(counts))
        yield descriptors[offsets[start] : offsets[stop]], counts[start:stop]
