"""A compiled XCiT traces in one graph, under CPU autocast and without, on every torch the project accepts.

On torch 2.6 to 2.11 dynamo could not trace ``torch._C._is_autocast_available`` (``torch.amp.
is_autocast_available``), which XCA asked once per block: the backbone's graph broke inside every block, and
each piece ran as a graph of its own. Torch 2.12 on folds that call to a constant, so the break showed on older
torch only; ``tests/min_versions.sh`` runs this file on the oldest torch pyproject.toml accepts. Dynamo decides
where to break before any backend sees a graph, so the ``eager`` backend stands in for inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from ssl_xcit.models import create_model
from ssl_xcit.models.layers import XCA

AUTOCAST = pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "autocast-off"]
)


@pytest.fixture
def graph_breaks():
    """The graph breaks dynamo counted in the test, by reason."""
    torch._dynamo.reset()
    counters.clear()
    yield lambda: dict(counters["graph_break"])
    torch._dynamo.reset()


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


@AUTOCAST
def test_compiled_xca_has_no_graph_break(graph_breaks, dtype):
    """A float32 input: XCA asks the autocast state (in a backbone, CPU float16 autocast hands it float16,
    which answers first; CUDA's hands it float32, as here)."""
    attn = XCA(64, 4, qkv_bias=True)
    x = torch.randn(2, 4, 64, requires_grad=True)
    with _autocast(dtype):
        out = torch.compile(attn, backend="eager", dynamic=False)(x)
    out.float().sum().backward()
    breaks = graph_breaks()
    assert not breaks, f"graph breaks in a compiled XCA (torch {torch.__version__}): {breaks}"
    assert counters["stats"]["unique_graphs"] == 1
    assert x.grad is not None and attn.temperature.grad is not None


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,  # the others in -m slow (the default suite's time budget): XCA's cases cover them
        pytest.param(torch.float16, marks=pytest.mark.slow),
        pytest.param(None, marks=pytest.mark.slow),
    ],
    ids=["bf16", "fp16", "autocast-off"],
)
def test_compiled_xcit_has_no_graph_break(graph_breaks, dtype):
    """The masked patch pass (iBOT's; the plain forward is its unmasked part): XCA blocks, class attention."""
    torch.manual_seed(0)
    backbone = create_model("xcit_nano_12_p8", depth=1).train()
    backbone.enable_masking()
    x = torch.randn(2, 3, 16, 16)  # 4 patch tokens
    mask = torch.tensor([[True, False, False, False]] * 2)
    patch_pass = torch.compile(backbone.forward_cls_patches, backend="eager", dynamic=False)
    with _autocast(dtype):
        cls, patches = patch_pass(x, mask=mask)
    (cls.float().sum() + patches.float().sum()).backward()
    breaks = graph_breaks()
    assert not breaks, f"graph breaks in the compiled XCiT (torch {torch.__version__}): {breaks}"
    assert counters["stats"]["unique_graphs"] == 1
    assert all(p.grad is not None for p in backbone.blocks.parameters())
