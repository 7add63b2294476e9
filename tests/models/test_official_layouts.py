"""Each family's official checkpoint, in the layout its authors' code saves it, loads strictly (issue 19.8).

``data/official_layouts.json`` lists every state-dict key and shape of one official model per family, read from
``state_dict()`` of the official code at the commit named in its ``source`` (block indices folded into ranges:
``blocks.{0-11}.norm1.weight``). Each test rebuilds that state dict with random values, wraps it the way the
official code saves it (container, ``module.`` prefix, training metadata) and loads it with ``strict=True``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from torch import Tensor

from ssl_xcit.models import build_backbone, create_model, load_pretrained

LAYOUTS = json.loads((Path(__file__).parent / "data" / "official_layouts.json").read_text())
_INTEGER = ("num_batches_tracked", "relative_position_index")
_CF_V1_TINY = dict(
    embed_dim=64, depths=(1, 1, 8, 6), num_heads=(2, 4, 8, 16), group_size=(7, 7, 7, 7), interval=(8, 4, 2, 1),
    use_acl=False,
)  # fmt: skip


def _expand(name: str) -> list[str]:
    """``a.{0-2}.b`` -> ``a.0.b, a.1.b, a.2.b``; ``a.{2,5}.b`` -> ``a.2.b, a.5.b``."""
    found = re.search(r"\{([\d,-]+)\}", name)
    if found is None:
        return [name]
    indices = []
    for part in found.group(1).split(","):
        first, _, last = part.partition("-")
        indices += range(int(first), int(last or first) + 1)
    return [f"{name[: found.start()]}{i}{name[found.end() :]}" for i in indices]


def official_state(layout: str) -> dict[str, Tensor]:
    """The official model's state dict: every key and shape of ``layout``, with random values."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in LAYOUTS[layout]["keys"].items():
        for key in _expand(name):
            if key.endswith(_INTEGER):
                state[key] = torch.randint(0, 100, shape, generator=g)
            else:
                state[key] = torch.randn(shape, generator=g)
    return state


def _official_tensor(state: dict[str, Tensor], key: str) -> Tensor:
    """The official tensor behind one of our keys: the same name, or XCiT's renamed / fused ones."""
    if key in state:
        return state[key]
    if key.startswith("pos_embed."):
        return state["pos_embeder." + key[len("pos_embed.") :]]
    stem, part, kind = re.fullmatch(r"(cls_attn_blocks\.\d+\.attn)\.([qkv])\.(weight|bias)", key).groups()
    return state[f"{stem}.qkv.{kind}"].chunk(3)["qkv".index(part)]


def assert_holds_official(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Every tensor of ``model`` is the official one it stands for, bit for bit."""
    for key, value in model.state_dict().items():
        torch.testing.assert_close(
            value, _official_tensor(state, key).to(value.dtype), rtol=0, atol=0, msg=key
        )


# layout -> (how the official code saves it, our model, constructor overrides)
CASES = {
    # Supervised XCiT releases hold the state dict under "model" (DINO's backbone files are plain: test_checkpoint).
    "xcit": (lambda sd: {"model": sd, "epoch": 400}, "xcit_nano_12_p16", {}),
    # DeiT's CaiT releases: under "model", saved from DDP ("module." prefix, which deit's own loader strips).
    "cait": (lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}}, "cait_xxs24", {}),
    # DINO's backbone releases (dino_deitsmall16_pretrain.pth): a plain headless state dict.
    "vit": (lambda sd: sd, "vit_small_patch16_224", {}),
    # CrossFormer's utils.save_checkpoint (its yacs config left out: it is not a weights-only type).
    "crossformerpp": (
        lambda sd: {"model": sd, "epoch": 299, "max_accuracy": 81.5},
        "crossformerpp_small",
        {},
    ),
    "crossformer_v1": (lambda sd: {"model": sd, "epoch": 299}, "crossformerpp_small", _CF_V1_TINY),
    # BiXT's timm CheckpointSaver (model_best.pth.tar), with the argparse namespace it records.
    "bixt": (
        lambda sd: {
            "epoch": 799,
            "arch": "bixt_ti_l64_p16",
            "state_dict": sd,
            "version": 2,
            "args": argparse.Namespace(model="bixt_ti_l64_p16"),
            "metric": 80.1,
        },
        "bixt_ti_l64_p16",
        {},
    ),
}


@pytest.mark.parametrize("layout", list(CASES))
def test_official_layout_loads_strictly_with_and_without_the_head(layout):
    wrap, name, overrides = CASES[layout]
    state = official_state(layout)
    has_head = "head.weight" in state

    headless = create_model(name, **overrides)
    report = load_pretrained(headless, wrap(state), strict=True)
    assert report.missing == [] and report.unexpected == []
    assert report.dropped_head == (["head.weight", "head.bias"] if has_head else [])
    assert_holds_official(headless, state)

    if has_head:  # a classifier of the official width keeps the official head
        classifier = create_model(name, num_classes=1000, **overrides)
        load_pretrained(classifier, wrap(state), strict=True)
        assert_holds_official(classifier, state)


@pytest.mark.parametrize("layout", [k for k, (_, _, overrides) in CASES.items() if not overrides])
def test_official_file_builds_its_registered_variant(layout, tmp_path):
    """From a file: the architecture is inferred from the official keys alone (no name given)."""
    wrap, name, _ = CASES[layout]
    state = official_state(layout)
    path = tmp_path / "official.pth"
    torch.save(wrap(state), path)
    model = build_backbone(path)
    assert model.name == name
    assert_holds_official(model, state)


@pytest.mark.parametrize(
    "layout,stray",
    [("bixt", "fourier_pos_encode.pos_extra"), ("crossformer_v1", "layers.0.blocks.0.attn.biases_old")],
)
def test_only_the_recomputed_buffers_are_dropped(layout, stray):
    """The family filters drop the size-bound buffers by exact name; any other stray key is still refused."""
    wrap, name, overrides = CASES[layout]
    state = {**official_state(layout), stray: torch.zeros(1)}
    with pytest.raises(ValueError, match=rf"unexpected keys \['{re.escape(stray)}'\]"):
        load_pretrained(create_model(name, **overrides), wrap(state), strict=True)
