"""A compiled backbone keeps one graph per crop size whatever the batch size: a batch with unreadable images
dropped, or an epoch's short last batch, does not recompile. Dynamo decides what to recompile before any
backend sees a graph, so the ``eager`` backend stands in for inductor (which takes minutes on this CPU); the
count is dynamo's own (``torch._dynamo.utils.counters``)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import ssl_xcit.dino.multicrop as multicrop
from ssl_xcit.dino.multicrop import MultiCropWrapper
from ssl_xcit.evaluation.embed import embed_dataset
from ssl_xcit.models import create_model
from ssl_xcit.utils.compile import dynamic_batch


class TinyBackbone(nn.Module):
    """A patch embedding and a mean: what the compiled passes need of a backbone, traced in a moment."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 8, 8)
        self.mask_token = nn.Parameter(torch.ones(8))

    def forward_cls_patches(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        tokens = self.proj(x).flatten(2).transpose(1, 2)
        if mask is not None:
            tokens = torch.where(mask.unsqueeze(-1), self.mask_token, tokens)
        return tokens.mean(1), tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_cls_patches(x)[0]


@pytest.fixture
def eager_compile(monkeypatch):
    compile_fn = torch.compile  # Module.compile() calls it too
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_fn(fn, **{**kw, "backend": "eager"}))
    multicrop._compiled.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    yield
    multicrop._compiled.cache_clear()
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _passes(model: MultiCropWrapper, width: int) -> None:
    """Training passes at batch sizes 4, 3, 5 (2 global 16 px + 2 local 8 px crops per image), iBOT's
    masked pass at 4 and 3, then the k-NN monitor's embedding of 10 images in batches of 4 (a last of 2)."""
    with torch.no_grad():
        for batch in (4, 3, 5):
            crops = [torch.randn(batch, 3, s, s) for s in (16, 16, 8, 8)]
            assert model(crops).shape == (4 * batch, width)
        assert _graphs() == 2  # one per crop size (6 with the batch size static)
        for batch in (4, 3):
            masks = torch.zeros(2 * batch, 4, dtype=torch.bool)
            masks[:, 0] = True
            model.forward_with_patches([torch.randn(batch, 3, 16, 16) for _ in range(2)], masks)
        assert _graphs() == 3
    model.backbone.eval()
    images = [(torch.randn(3, 16, 16), 0) for _ in range(10)]
    assert embed_dataset(model.backbone, images, batch_size=4)["features"].shape == (10, width)


def test_new_batch_sizes_do_not_recompile(eager_compile):
    model = MultiCropWrapper(TinyBackbone(), nn.Identity())
    model.compile_backbone()
    _passes(model, 8)
    assert _graphs() == 3  # the monitor's batches of 4 and of 2 reuse the 16 px graph


@pytest.mark.slow  # ~30 s on 2 busy CPU cores: dynamo traces XCiT
def test_new_batch_sizes_do_not_recompile_xcit(eager_compile):
    backbone = create_model("xcit_nano_12_p8", depth=1)
    backbone.enable_masking()
    model = MultiCropWrapper(backbone, nn.Identity())
    model.compile_backbone()
    _passes(model, 128)
    assert _graphs() == 4  # eval mode is a graph of its own (BatchNorm), the short batch is not


def test_dynamic_batch_marks_the_first_dimension_only():
    x = dynamic_batch(torch.zeros(3, 2))
    assert getattr(x, "_dynamo_weak_dynamic_indices", set()) == {0}
