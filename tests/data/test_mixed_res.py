"""DINOv3's mixed-resolution high-resolution stage (``high_res_crops_size`` as a list of (global, local) pairs with
``high_res_crops_ratios``, ``ssl_xcit.data.stages.CropMix``): the draw of each batch's pair against numpy's
``Generator.choice`` on the same seeded stream, the ratios over many batches, one size per crop kind in every
batch (CPU and device crops, the Gram teacher's at 1.5x), the same pairs on every rank, a mid-epoch resume that
continues the sequence, and one-line errors."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.resumable import ResumableSampler, resumable_loader
from ssl_xcit.data.stages import _MIX_STREAM, CropMix, check_high_res
from ssl_xcit.data.transfer import augment_batch
from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError

from .test_datamodule import make_tree

# DINOv3's high-resolution adaptation (dinov3_vit7b16_high_res_adapt.yaml, crops.*).
DINOV3_SIZES = [(512, 112), (768, 112), (768, 168), (768, 224), (768, 336)]
DINOV3_RATIOS = [0.3, 0.3, 0.3, 0.05, 0.05]


def test_the_draw_is_numpys_choice_on_the_seeded_stream_and_keeps_the_ratios():
    mix = check_high_res(2, DINOV3_SIZES, DINOV3_RATIOS)
    n = 20_000
    got = mix.pairs(seed=7, epoch=3, num_batches=n)
    want = np.random.default_rng([_MIX_STREAM, 7, 3]).choice(5, size=n, p=DINOV3_RATIOS)
    assert np.array_equal(got, want)
    counts = np.bincount(got, minlength=5)
    expected = n * np.array(DINOV3_RATIOS)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # 4 degrees of freedom, p = 0.001
    # Another epoch or seed is another sequence; the same (seed, epoch) is the same one.
    assert not np.array_equal(mix.pairs(7, 4, 100), got[:100])
    assert not np.array_equal(mix.pairs(8, 3, 100), got[:100])
    assert np.array_equal(mix.pairs(7, 3, 100), got[:100])
    # A pair with ratio 0 is never drawn; one pair needs no ratios.
    assert 1 not in check_high_res(1, [[32, 16], [48, 16]], [1, 0]).pairs(0, 0, 1000)
    assert check_high_res(1, [448, 192]) == CropMix(((448, 192),), (1.0,))


class Keys(Dataset):
    """Items that show their key: ``(index, pair)``."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, key):
        index, pair = key
        return [torch.tensor([pair])], -1, index


def _pairs(batches) -> list[int]:
    out = []
    for crops, _, _ in batches:
        assert len(set(crops[0].flatten().tolist())) == 1  # one pair per batch
        out.append(int(crops[0].flatten()[0]))
    return out


def test_both_ranks_draw_the_same_pairs_per_batch():
    mix = check_high_res(1, DINOV3_SIZES, DINOV3_RATIOS)
    seen = []
    for rank in (0, 1):
        sampler = ResumableSampler(Keys(), 2, rank, seed=5, batch_pairs=mix.pairs, batch_size=4)
        sampler.set_epoch(2)
        keys = list(sampler)
        batches = [keys[i : i + 4] for i in range(0, len(keys), 4)]
        assert all(len({p for _, p in b}) == 1 for b in batches)
        seen.append([b[0][1] for b in batches])
    assert seen[0] == seen[1] == mix.pairs(5, 2, 8).tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_resume_continues_the_sequence(workers):
    mix = check_high_res(1, DINOV3_SIZES, DINOV3_RATIOS)
    first = resumable_loader(Keys(), 4, collate_train, num_workers=workers, seed=3, batch_pairs=mix.pairs)
    first.sampler.set_epoch(1)
    whole = _pairs(first)
    assert whole == mix.pairs(3, 1, 16).tolist() and len(set(whole)) > 2
    first.sampler.set_epoch(1)
    iterator = iter(first)
    taken = [next(iterator) for _ in range(5)]
    state = first.state_dict()
    del iterator
    second = resumable_loader(Keys(), 4, collate_train, num_workers=workers, seed=3, batch_pairs=mix.pairs)
    second.load_state_dict(state)  # its sampler is at epoch 0 until the state says 1
    assert _pairs(taken) + _pairs(second) == whole


PAIRS = [[48, 16], [32, 16], [32, 8]]
RATIOS = [0.4, 0.4, 0.2]


def _datamodule(root, **overrides) -> DINODataModule:
    return DINODataModule(
        root=str(root), batch_size=4, num_workers=0, persistent_workers=False, global_crops_size=16,
        local_crops_size=8, local_crops_number=1, high_res_epochs=1, high_res_crops_size=PAIRS,
        high_res_crops_ratios=RATIOS, **overrides,
    )  # fmt: skip


@pytest.mark.parametrize("augment_on", ["cpu", "device"])
def test_every_batch_of_the_stage_has_its_pairs_sizes_and_gram_crops_at_1_5x(
    tmp_path, augment_on, monkeypatch
):
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    root = make_tree(tmp_path / "data", per_class=16, size=40)
    dm = _datamodule(root, augment_on=augment_on)
    dm.trainer = SimpleNamespace(
        current_epoch=1, max_epochs=2, world_size=1, global_rank=0, lightning_module=None, strategy=None
    )
    dm.setup("fit")
    dm.use_gram_crops(1.5)
    want = [PAIRS[p] for p in dm.high_res.pairs(11, 1, 8)]
    seen = []
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)  # as Lightning does
    for batch in loader:
        if augment_on == "device":
            batch, _ = augment_batch(
                batch, dm.reader, dm.device_augment, lambda: np.random.default_rng(0), None
            )
        crops, gram = batch[0]["crops"], batch[0]["gram_crops"]
        sides = [c.shape[-1] for c in crops]
        assert sides[:2] == [sides[0]] * 2 and [g.shape[-1] for g in gram] == [int(1.5 * sides[0])] * 2
        assert all(c.shape[0] == 4 for c in [*crops, *gram])
        seen.append([sides[0], sides[-1]])
    assert seen == want and len({tuple(s) for s in seen}) > 1


def test_bad_mixes_are_one_line_errors_naming_the_value(tmp_path):
    cases = [
        (dict(high_res_crops_size=PAIRS), r"has 3 \(global, local\) pairs: set high_res_crops_ratios"),
        (dict(high_res_crops_size=PAIRS, high_res_crops_ratios=[0.5, 0.5]), r"one value per .* \(3\), got \[0.5, 0.5\]"),
        (dict(high_res_crops_size=PAIRS, high_res_crops_ratios=[0, 0, 0]), r">= 0 with a sum > 0, got \[0, 0, 0\]"),
        (dict(high_res_crops_size=PAIRS, high_res_crops_ratios=[1, -1, 1]), r"got \[1, -1, 1\]"),
        (dict(high_res_crops_size=[[48, 16], [32]], high_res_crops_ratios=[1, 1]), r"needs high_res_crops_size: .* got \[\[48, 16\], \[32\]\]"),
        (dict(high_res_crops_size=[[48, 0]], high_res_crops_ratios=[1]), r"got \[\[48, 0\]\]"),
        (dict(high_res_crops_size=(448,)), r"got \(448,\)"),
    ]  # fmt: skip
    for overrides, match in cases:
        with pytest.raises(UserError, match=match) as err:
            DINODataModule(high_res_epochs=2, **overrides)
        assert "\n" not in str(err.value)


TINY = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, out_dim=32, head_hidden_dim=16,
            head_bottleneck_dim=8, warmup_epochs=0, sync_every_n_steps=1)  # fmt: skip


class Sides(L.Callback):
    """(global, local, Gram teacher) sides of every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        crops = batch[0]
        self.seen.append(
            (crops["crops"][0].shape[-1], crops["crops"][-1].shape[-1], crops["gram_crops"][0].shape[-1])
        )


def _trainer(tmp_path, callbacks) -> L.Trainer:
    return L.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=callbacks,
        limit_val_batches=0,
    )  # fmt: skip


@pytest.mark.slow
def test_a_fit_trains_the_mix_with_gram_at_1_5x_and_a_mid_stage_resume_continues_it(tmp_path):
    """16 images, 4 steps an epoch: epoch 0 at the base sizes, epoch 1 the mix; resumed from step 6 (2 batches
    into the stage) the run's last 2 batches are the uninterrupted run's."""
    root = make_tree(tmp_path / "data", per_class=8, size=40)
    sides = Sides()
    every_step = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    model = dict(**TINY, gram_loss_weight=1.0, gram_start_step=0, gram_resolution_scale=1.5)
    L.seed_everything(0)
    _trainer(tmp_path, [sides, every_step]).fit(DINO(**model), datamodule=_datamodule(root))
    mix = check_high_res(1, PAIRS, RATIOS)
    stage = [(g, loc, int(1.5 * g)) for g, loc in (PAIRS[p] for p in mix.pairs(0, 1, 4))]
    assert sides.seen == [(16, 8, 24)] * 4 + stage and len(set(stage)) > 1

    resumed = Sides()
    L.seed_everything(0)
    _trainer(tmp_path, [resumed]).fit(
        DINO(**model), datamodule=_datamodule(root), ckpt_path=str(tmp_path / "ckpt" / "step=6.ckpt")
    )
    assert resumed.seen == stage[2:]


def test_the_recipes_dinov3_mix_is_dinov3s_scaled_to_its_sides():
    """recipes/continue_dinov3.yaml carries DINOv3's mix as a comment to put in place of its one pair: its pairs
    are DINOv3's x 224 / 256 on 16-px patches, its ratios DINOv3's, and the datamodule takes them."""
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).parents[2] / "recipes" / "continue_dinov3.yaml").read_text()
    lines = re.findall(r"^\s*# (high_res_crops_(?:size|ratios): \[.*\])$", text, flags=re.M)
    mix = yaml.safe_load("\n".join(lines))
    scaled = [[round(g * 224 / 256 / 16) * 16, round(loc * 224 / 256 / 16) * 16] for g, loc in DINOV3_SIZES]
    assert mix["high_res_crops_size"] == scaled and mix["high_res_crops_ratios"] == DINOV3_RATIOS
    recipe = yaml.safe_load(text)["data"]["init_args"]
    assert recipe["global_crops_size"] == 224 and recipe["local_crops_size"] == 96
    built = DINODataModule(high_res_epochs=2, **mix)
    assert [list(s) for s in built.high_res.sizes] == scaled
