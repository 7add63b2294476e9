"""The registry picks up any family module listed in FAMILIES and skips one that is absent from the checkout."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from ssl_xcit.models import registry
from ssl_xcit.models.base import Backbone


class _Toy(Backbone):
    family = "toyfam"

    def __init__(self, width: int = 8, num_classes: int = 1000) -> None:
        super().__init__()
        self.embed_dim = self.dense_dim = width
        self.num_classes = num_classes
        self.proj = nn.Linear(3, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.mean((-2, -1)))


@pytest.fixture
def toy_family(monkeypatch):
    module = types.ModuleType("ssl_xcit.models.toyfam")
    _Toy.__module__ = module.__name__
    module._Toy = _Toy
    module.VARIANTS = {"toy_small": {"width": 8}, "toy_big": {"width": 16}}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(registry, "FAMILIES", (*registry.FAMILIES, "toyfam", "nosuchfam"))
    registry._family_modules.cache_clear()
    yield
    registry._family_modules.cache_clear()


def test_listed_family_is_registered_and_missing_one_skipped(toy_family):
    assert "toyfam" in registry.list_families() and "nosuchfam" not in registry.list_families()
    assert registry.list_models("toyfam") == ["toy_small", "toy_big"]
    model = registry.create_model("toy_big")
    assert isinstance(model, _Toy) and model.name == "toy_big" and model.embed_dim == 16
    assert model.num_classes == 0  # the registry builds backbones whatever the family's default
    with pytest.raises(ValueError, match="(?s)toyfam: toy_small, toy_big"):
        registry.create_model("toy_huge")
    with pytest.raises(TypeError, match="'widht'.*takes width, num_classes"):
        registry.create_model("toy_small", widht=4)


def test_shape_inference_follows_a_variant_whose_arguments_change(toy_family, monkeypatch):
    """Variant shapes are built once per process (ssl_xcit.models.checkpoint); a variant re-registered under the
    same name with other arguments is matched on its new shapes, not on the remembered ones."""
    from ssl_xcit.models import infer_model_name

    module = sys.modules["ssl_xcit.models.toyfam"]
    state = registry.create_model("toy_big").state_dict()
    assert infer_model_name(state) == "toy_big"
    monkeypatch.setitem(module.VARIANTS, "toy_big", {"width": 32})
    assert infer_model_name(state) is None
    assert infer_model_name(registry.create_model("toy_big").state_dict()) == "toy_big"
