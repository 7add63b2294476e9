"""k-NN and the linear probe on every backbone family: through the CLI (flowers5, 20 images, depth 1), and the
probe with pooled patch tokens on random images."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ssl_xcit.cli import main
from ssl_xcit.evaluation.features import FeatureConfig, compute_features
from ssl_xcit.evaluation.knn import knn_accuracy
from ssl_xcit.evaluation.linear import LinearProbe
from ssl_xcit.models import create_model

FAMILIES = [
    ("cait_xxs24", {"depth": 1}),
    ("vit_small_patch16_224", {"depth": 1}),
    ("crossformerpp_small", {"depths": (1, 1, 1, 1)}),
    ("bixt_ti_l64_p16", {"depth": 2}),
]


def _weights(tmp_path, name, kwargs):
    torch.manual_seed(0)
    model = create_model(name, **kwargs)
    path = tmp_path / f"{name}.pth"
    # The ssl-xcit export layout: name and kwargs recorded, so --arch is not needed for a truncated model.
    torch.save(
        {"state_dict": model.state_dict(), "hyper_parameters": {"backbone": name, "backbone_kwargs": kwargs}},
        path,
    )
    return path, model.eval()


def _args(weights, train, val, cache):
    return ["--weights", str(weights), "--train", str(train), "--val", str(val), "--resize-size", "37",
            "--crop-size", "32", "--batch-size", "20", "--num-workers", "0", "--accelerator", "cpu",
            "--devices", "1", "--cache-dir", str(cache), "--no-progress"]  # fmt: skip


@pytest.mark.parametrize("name,kwargs", FAMILIES)
def test_knn_and_linear_run_on_the_family(name, kwargs, twenty_flowers, tmp_path):
    train, val = twenty_flowers
    weights, model = _weights(tmp_path, name, kwargs)
    knn = main(["knn", *_args(weights, train, val, tmp_path / "cache"), "--k", "3"])
    assert knn["num_train"] == 15 and knn["num_val"] == 5 and knn["num_classes"] == 5
    # Same numbers as k-NN on features computed by hand from the same backbone.
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.transforms import eval_transform

    transform = eval_transform(resize=37, crop=32)
    tr, va = build_dataset(train, transform), build_dataset(val, transform)
    with torch.no_grad():
        ftr = model(torch.stack([tr[i][0] for i in range(len(tr))]))
        fva = model(torch.stack([va[i][0] for i in range(len(va))]))
    direct = knn_accuracy(ftr, torch.tensor(tr.targets), fva, torch.tensor(va.targets), ks=(3,))
    assert knn["results"]["3"]["top1"] == pytest.approx(direct[3]["top1"])
    linear = main(["linear", *_args(weights, train, val, tmp_path / "cache"), "--fast", "--epochs", "2",
                   "--lrs", "0.01", "--default-root-dir", str(tmp_path / "lin")])  # fmt: skip
    assert (
        linear["num_classes"] == 5 and linear["feature_dim"] == model.embed_dim and linear["num_train"] == 15
    )
    assert 0.0 <= linear["best"]["top1"] <= 100.0


# Concatenating the CLS of the last n blocks needs blocks of one width; CrossFormer++'s four stages differ.
@pytest.mark.parametrize("name,kwargs", [f for f in FAMILIES if f[0] != "crossformerpp_small"])
def test_linear_probe_features_of_the_family(name, kwargs):
    torch.manual_seed(0)
    model = create_model(name, **{**kwargs, "depth": 3}).eval()
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        cls = compute_features(model, x)
        four = compute_features(model, x, FeatureConfig(3, True))
        tokens, _ = model.forward_patch_tokens(x)
    c = model.embed_dim
    assert four.shape == (2, 4 * c)
    torch.testing.assert_close(four[:, 2 * c : 3 * c], cls, rtol=1e-4, atol=1e-5)  # the last block's CLS
    torch.testing.assert_close(four[:, 3 * c :], tokens.mean(1))


@pytest.mark.parametrize("name,kwargs", [("xcit_nano_12_p16", {"depth": 1}), *FAMILIES])
def test_linear_probe_with_pooled_patch_tokens_trains_on_the_family(name, kwargs, tmp_path):
    """Full-mode ``--avgpool-patchtokens``: heads sized from ``dense_dim`` (CrossFormer++'s stage-3 tokens are
    half its embedding width), then a training step and a validation pass on images."""
    weights, model = _weights(tmp_path, name, kwargs)
    probe = LinearProbe(
        weights=str(weights), num_classes=3, avgpool_patchtokens=True, lrs=[0.1], per_device_batch_size=4
    )
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    with torch.no_grad():
        expected = compute_features(model, images, FeatureConfig(1, True))
    assert probe.feature_dim == model.embed_dim + model.dense_dim == expected.shape[1]
    with torch.no_grad():
        assert [logits.shape for logits in probe(images)] == [(4, 3)]
    head = probe.heads[0].weight.clone()
    loader = DataLoader(TensorDataset(images, labels), batch_size=4)
    probe.write_on_fit_end = False
    trainer = pl.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(probe, loader, loader)
    assert trainer.global_step == 1 and not torch.equal(probe.heads[0].weight, head)
    assert probe.results is not None and 0.0 <= probe.results["best"]["top1"] <= 100.0
