"""Which patch tokens VLAD and ASMK describe images with (``local_tokens``)."""

from __future__ import annotations

import pytest
import torch

from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model
from ssl_xcit.retrieval.config import RetrievalConfig
from ssl_xcit.retrieval.descriptors import extract_local, select_local
from ssl_xcit.retrieval.images import ImageList


@pytest.fixture(scope="module")
def images(shared_data):
    paths = sorted((shared_data / "retrieval_mini" / "holidays").glob("*.jpg"))[:2]
    return ImageList(paths, resolution=64, patch_size=16)


def _expected(model, images, which):
    out = []
    for x, _ in images:
        tokens = (
            model.forward_cls_patches(x[None])[1]
            if which == "final_norm"
            else model.forward_patch_tokens(x[None])[0]
        )
        out.append(select_local(tokens[0], None))
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["xcit_nano_12_p16", "vit_tiny_patch16_224"])
def test_local_tokens_choose_the_tokens(arch, images):
    torch.manual_seed(0)
    model = create_model(arch, depth=2).eval()
    got = {}
    for which in ("last_block", "final_norm"):
        desc, counts = extract_local(model, images, max_local=None, tokens=which, dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(desc, _expected(model, images, which))
        got[which] = desc
    # XCiT's class attention and final norm change the patch tokens; ViT's patch tokens are already final.
    same = got["last_block"].shape == got["final_norm"].shape and torch.allclose(
        got["last_block"], got["final_norm"]
    )
    assert same == arch.startswith("vit")


def test_unknown_local_tokens_are_named():
    with pytest.raises(UserError, match="unknown local_tokens 'middle'; valid: last_block, final_norm"):
        RetrievalConfig(dataset="folder", data_root=".", local_tokens="middle").validate()
