"""Backbone arguments that YAML misread are refused, not dropped."""

from __future__ import annotations

import pytest
import yaml

from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "xcit_nano_12_p8"])
def test_yaml_flow_mapping_without_spaces_is_named(name):
    kwargs = yaml.safe_load("{depth:4,patch_size:8}")  # {'depth:4': None, 'patch_size:8': None}
    with pytest.raises(
        UserError, match=r"\['depth:4', 'patch_size:8'\] are not names; in YAML write a space"
    ):
        create_model(name, **kwargs)
    assert len(create_model(name, **yaml.safe_load("{depth: 1}")).blocks) == 1
