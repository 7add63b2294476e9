"""Backbones behind one interface (:class:`Backbone`), one registry for every family, and checkpoint loading.

>>> from ssl_xcit.models import create_model, list_models
>>> model = create_model("cait_xxs24")                     # global (CLS) embedding model, num_classes=0
>>> tokens, (h, w) = model.forward_patch_tokens(images)     # dense descriptors and their grid
"""

from ssl_xcit.models.base import AttentionNotSupported, Backbone
from ssl_xcit.models.checkpoint import (
    LoadReport,
    build_backbone,
    convert_state_dict,
    extract_state_dict,
    infer_architecture,
    infer_family,
    infer_model_name,
    load_pretrained,
    read_checkpoint,
)
from ssl_xcit.models.registry import (
    FAMILIES,
    canonical_name,
    create_model,
    describe,
    family_of,
    list_families,
    list_models,
    model_config,
    supervised_drop_path,
)
from ssl_xcit.models.xcit import SIZES, XCiT
from ssl_xcit.models.xcit import VARIANTS as MODEL_CONFIGS  # the XCiT table, under its former name

__all__ = [
    "FAMILIES",
    "MODEL_CONFIGS",
    "SIZES",
    "AttentionNotSupported",
    "Backbone",
    "LoadReport",
    "XCiT",
    "build_backbone",
    "canonical_name",
    "convert_state_dict",
    "create_model",
    "describe",
    "extract_state_dict",
    "family_of",
    "infer_architecture",
    "infer_family",
    "infer_model_name",
    "list_families",
    "list_models",
    "load_pretrained",
    "model_config",
    "read_checkpoint",
    "supervised_drop_path",
]
