"""XCiT backbones: a registry of the 14 paper variants and a loader for every common checkpoint layout.

>>> from ssl_xcit.models import create_model
>>> model = create_model("xcit_small_12_p16")          # CLS embedding model (num_classes=0)
>>> tokens, (h, w) = model.forward_patch_tokens(images)  # patch tokens before class attention
"""

from ssl_xcit.models.checkpoint import (
    LoadReport,
    build_backbone,
    convert_state_dict,
    extract_state_dict,
    infer_architecture,
    infer_model_name,
    load_pretrained,
    read_checkpoint,
)
from ssl_xcit.models.registry import (
    MODEL_CONFIGS,
    SIZES,
    canonical_name,
    create_model,
    describe,
    list_models,
    model_config,
    supervised_drop_path,
)
from ssl_xcit.models.xcit import XCiT

__all__ = [
    "MODEL_CONFIGS",
    "SIZES",
    "LoadReport",
    "XCiT",
    "build_backbone",
    "canonical_name",
    "convert_state_dict",
    "create_model",
    "describe",
    "extract_state_dict",
    "infer_architecture",
    "infer_model_name",
    "list_models",
    "load_pretrained",
    "model_config",
    "read_checkpoint",
    "supervised_drop_path",
]
