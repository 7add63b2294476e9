"""The in-process extraction loop gives the Trainer path's features and hands modules back in their modes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from ssl_xcit.evaluation.embed import embed_dataset
from ssl_xcit.evaluation.features import FeatureConfig, extract_features
from ssl_xcit.models import create_model
from ssl_xcit.trainer.callbacks import OnlineKNN

from .helpers import ARCH


class Images(Dataset):
    """Random images; item 3 is "unreadable" (None), as ImageDataset returns for a corrupt file."""

    def __init__(self, n: int = 7) -> None:
        self.x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return None if i == 3 else (self.x[i], i % 2, i)


@pytest.mark.parametrize("config", [FeatureConfig(), FeatureConfig(2, True)], ids=["cls", "cls2+avgpool"])
def test_embed_dataset_matches_extract_features(config):
    torch.manual_seed(0)
    model = create_model(ARCH)
    ds = Images()
    loop = embed_dataset(model, ds, config=config, batch_size=3)
    trainer_path = extract_features(
        model, ds, config=config, batch_size=3, num_workers=0, accelerator="cpu", devices=1, progress=False
    )
    assert loop["labels"].tolist() == trainer_path["labels"].tolist() == [0, 1, 0, 0, 1, 0]
    torch.testing.assert_close(loop["features"], trainer_path["features"])


def test_modes_restored_per_submodule_and_eval_inside():
    torch.manual_seed(0)
    model = create_model(ARCH).train()
    model.cls_attn_blocks.eval()
    before = {name: m.training for name, m in model.named_modules()}
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    embed_dataset(model, Images(), batch_size=4)
    assert seen == [False, False]
    assert {name: m.training for name, m in model.named_modules()} == before


def test_online_knn_uses_the_same_features():
    torch.manual_seed(0)
    model = create_model(ARCH).train()
    feats, labels = OnlineKNN(batch_size=2)._features(model, Images(), torch.device("cpu"))
    reference = embed_dataset(model, Images(), batch_size=5)
    torch.testing.assert_close(feats, reference["features"])
    assert labels.tolist() == reference["labels"].tolist() and model.training


def test_all_unreadable_is_a_clear_error():
    class Broken(Images):
        def __getitem__(self, i):
            return None

    with pytest.raises(ValueError, match="no readable image among the 7"):
        embed_dataset(lambda x: x.flatten(1), Broken())


def test_an_empty_share_is_allowed_when_asked():
    """One process's share of a dataset split over processes may hold no readable image (online k-NN)."""

    class Broken(Images):
        def __getitem__(self, i):
            return None

    for dataset in (Broken(), torch.utils.data.Subset(Images(), [])):
        out = embed_dataset(lambda x: x.flatten(1), dataset, allow_empty=True)
        assert out["features"].shape == (0, 0) and out["labels"].shape == (0,)
