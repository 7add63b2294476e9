"""What the last release (commit 42a0f7d) wrote still works after ssl_xcit.trainer took the run machinery out of
ssl_xcit.dino: the class paths its recipes and saved configs name, its saved config (a fit runs on it), and
its checkpoint (load, export, resume).

The fixtures come from that release's ``ssl-xcit fit -c recipes/quickstart.yaml`` with a 1-block, 32-wide XCiT
and iBOT on (2 optimiser steps, batch 4): its checkpoint, and the config.yaml such a run saved."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import jsonargparse
import lightning as L
import pytest
import torch
from conftest import RandomCrops, tiny_loader, tiny_model
from PIL import Image

from ssl_xcit._renamed import RENAMED
from ssl_xcit.cli.export import main as export_main
from ssl_xcit.cli.train import main as cli_main
from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.resumable import resumable_loader
from ssl_xcit.dino.module import DINO
from ssl_xcit.models.checkpoint import read_checkpoint
from ssl_xcit.models.export import read_safetensors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RELEASE_CKPT = FIXTURES / "release_42a0f7d_dino_ibot.ckpt"
RELEASE_CONFIG = FIXTURES / "release_42a0f7d_config.yaml"

# Every class path of ours that a config saved by an earlier commit can name (recipes, the callbacks and model
# summary the CLI adds, checkpoint IO, strategy) and that has moved since, with where the class is now. From
# the git history: ssl_xcit.dino's run machinery moved to ssl_xcit.trainer (commit a681dc7), RankMe and
# FSDP2Strategy too (dino/rankme.py, dino/fsdp.py on their branches), SkippedImagesLogger left
# ssl_xcit.data.datamodule; then FSDP2 moved on to ssl_xcit.parallel and the collapse guard (and DINO's lifecycle
# hooks, which no config names) back to ssl_xcit.dino. Not here: ssl_xcit.dino.checkpointing.DINOCheckpoint,
# removed before the release (commit 58ca76d: stock ModelCheckpoint instances replaced it), which has no new
# class to be: a deprecated ModelCheckpoint with its old schedule stands in for it (REMOVED_CLASS_PATHS).
OLD_CLASS_PATHS = {
    "ssl_xcit.data.datamodule.SkippedImagesLogger": "ssl_xcit.data.callbacks.SkippedImagesLogger",
    "ssl_xcit.dino.callbacks.OnlineKNN": "ssl_xcit.trainer.callbacks.OnlineKNN",
    "ssl_xcit.dino.checkpointing.AtomicCheckpointIO": "ssl_xcit.trainer.checkpointing.AtomicCheckpointIO",
    "ssl_xcit.trainer.collapse.CollapseGuard": "ssl_xcit.dino.collapse.CollapseGuard",
    "ssl_xcit.dino.fsdp.FSDP2Strategy": "ssl_xcit.parallel.fsdp.FSDP2Strategy",
    "ssl_xcit.trainer.fsdp.FSDP2Strategy": "ssl_xcit.parallel.fsdp.FSDP2Strategy",
    "ssl_xcit.dino.preemption.PreemptionCheckpoint": "ssl_xcit.trainer.preemption.PreemptionCheckpoint",
    "ssl_xcit.dino.progress.SyncedRichProgressBar": "ssl_xcit.trainer.progress.SyncedRichProgressBar",
    "ssl_xcit.dino.rankme.RankMe": "ssl_xcit.trainer.rankme.RankMe",
}

# Class paths an earlier commit wrote whose class was removed, not moved: each still resolves, to a deprecated
# stand-in of the same kind (the base class a config's class_path must subclass).
REMOVED_CLASS_PATHS = {
    "ssl_xcit.dino.checkpointing.DINOCheckpoint": "lightning.pytorch.callbacks.ModelCheckpoint",
}


def _resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# The old module names that ssl_xcit._renamed answers (no file at those paths): importing one warns.
@pytest.mark.parametrize("old, new", sorted(OLD_CLASS_PATHS.items()))
def test_old_class_paths_are_the_new_classes(old, new):
    assert _resolve(old) is _resolve(new)


@pytest.mark.parametrize(
    "old, new", sorted(p for p in OLD_CLASS_PATHS.items() if p[0].rpartition(".")[0] in RENAMED)
)
def test_importing_an_old_module_warns_with_the_new_path(old, new):
    # A module is imported once per process: reloading it runs the warning again.
    module = importlib.import_module(old.rpartition(".")[0])
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        importlib.reload(module)


def test_a_config_naming_the_old_callback_path_builds_the_new_class():
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callback", type=L.Callback)
    config = parser.parse_args(
        ['--callback={"class_path": "ssl_xcit.dino.callbacks.OnlineKNN", "init_args": {"k": 5}}']
    )
    callback = parser.instantiate_classes(config).callback
    assert type(callback) is _resolve("ssl_xcit.trainer.callbacks.OnlineKNN") and callback.k == 5


@pytest.mark.parametrize("old, base", sorted(REMOVED_CLASS_PATHS.items()))
def test_removed_class_paths_resolve_to_a_stand_in(old, base):
    assert issubclass(_resolve(old), _resolve(base))


def _old_dino_checkpoint(init_args: dict) -> L.Callback:
    """``DINOCheckpoint`` as a pre-58ca76d config's ``trainer.callbacks`` entry builds it (old recipes:
    ``{dirpath: runs/quickstart/checkpoints, every_n_epochs: 2}``)."""
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callback", type=L.Callback)
    value = {"class_path": "ssl_xcit.dino.checkpointing.DINOCheckpoint", "init_args": init_args}
    config = parser.parse_args([f"--callback={json.dumps(value)}"])
    with pytest.warns(DeprecationWarning, match="DINOCheckpoint is deprecated"):
        return parser.instantiate_classes(config).callback


def test_a_config_naming_the_removed_dino_checkpoint_builds_it(tmp_path):
    callback = _old_dino_checkpoint({"dirpath": str(tmp_path / "ckpt"), "every_n_epochs": 2})
    assert type(callback) is _resolve("ssl_xcit.dino.checkpointing.DINOCheckpoint")
    # The old defaults: every copy kept, {epoch:04d} names, last.ckpt without a version counter.
    assert callback.dirpath == str(tmp_path / "ckpt") and callback.every_n_epochs == 2
    assert callback.save_top_k == -1 and callback.save_last is True and callback.monitor is None
    assert callback.filename == "{epoch:04d}" and not callback._enable_version_counter


def test_the_removed_dino_checkpoint_keeps_its_old_schedule(tmp_path):
    # Epochs 0, 1, 2 with every_n_epochs=2: a kept copy after epoch index 1 (the 2nd) and after the final one,
    # last.ckpt after each. The old class named its copies epoch=NNNN.ckpt by the 0-based epoch index.
    folder = tmp_path / "ckpt"
    callback = _old_dino_checkpoint({"dirpath": str(folder), "every_n_epochs": 2})
    saved = _SavedFiles(folder)
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback, saved],
        default_root_dir=tmp_path,
    )
    trainer.fit(tiny_model(), tiny_loader(n=8, batch_size=4))
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0001.ckpt", "epoch=0002.ckpt", "last.ckpt"]
    # Lightning runs checkpoint callbacks after the others: the files are looked at as the next epoch starts.
    # last.ckpt is rewritten after every epoch, a kept copy only every 2nd.
    assert saved.before_epoch == [([], None), (["last.ckpt"], 0), (["epoch=0001.ckpt", "last.ckpt"], 1)]
    assert read_checkpoint(folder / "last.ckpt")["epoch"] == 2


class _SavedFiles(L.Callback):
    """The checkpoint files in ``folder`` as each training epoch starts, and the epoch ``last.ckpt`` holds."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.before_epoch = folder, []

    def on_train_epoch_start(self, trainer, pl_module):
        last = self.folder / "last.ckpt"
        epoch = read_checkpoint(last)["epoch"] if last.exists() else None
        self.before_epoch.append((sorted(p.name for p in self.folder.glob("*.ckpt")), epoch))


def test_a_fit_runs_on_the_release_saved_config(tmp_path, monkeypatch):
    # The release's own config.yaml, with the PreemptionCheckpoint and CompactModelSummary its CLI added. Its
    # paths are relative (runs/quickstart/version_0/...): run from tmp_path, everything lands there. The one
    # override: 8 images for the built-in dataset (2,500 generated images and a k-NN over 500 of them; without
    # labels the k-NN switches itself off). The config's own max_steps (2) and batch (4) stand.
    for i in range(8):
        folder = tmp_path / "images" / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), (30 * i, 255 - 30 * i, 128)).save(folder / f"{i}.png")
    monkeypatch.chdir(tmp_path)
    # A class path it cannot resolve ends the CLI with SystemExit ("Problem with given class_path ...").
    cli = cli_main(["fit", "-c", str(RELEASE_CONFIG), "--data.init_args.root=images"])
    assert cli.trainer.global_step == 2
    preemption = _resolve("ssl_xcit.trainer.preemption.PreemptionCheckpoint")
    assert [type(cb) for cb in cli.trainer.callbacks].count(preemption) == 1
    last = tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    assert read_checkpoint(last)["global_step"] == 2


def _release() -> dict:
    return read_checkpoint(RELEASE_CKPT)


def test_the_release_checkpoint_loads_with_its_weights():
    checkpoint = _release()
    model = DINO.load_from_checkpoint(RELEASE_CKPT, map_location="cpu", weights_only=True)
    assert model.hparams.backbone_kwargs == {"depth": 1, "embed_dim": 32, "num_heads": 4}
    assert model.hparams.ibot_loss_weight == 1.0
    state = model.state_dict()
    assert set(state) == set(checkpoint["state_dict"])
    for key, tensor in checkpoint["state_dict"].items():
        assert torch.equal(state[key], tensor), key


def test_the_release_checkpoint_exports_its_teacher_backbone(tmp_path):
    out = tmp_path / "teacher.safetensors"
    export_main([str(RELEASE_CKPT), str(out)])
    exported = read_safetensors(out)["state_dict"]
    teacher = {
        k.removeprefix("teacher.backbone."): v
        for k, v in _release()["state_dict"].items()
        if k.startswith("teacher.backbone.")
    }
    teacher.pop("mask_token")  # a training input, which the export leaves out
    assert set(exported) == set(teacher)
    for key, tensor in teacher.items():
        assert torch.equal(exported[key], tensor), key


class _RestoredWeights(L.Callback):
    """The module's tensors once the trainer has restored the checkpoint, before the first resumed step."""

    def on_train_start(self, trainer, pl_module):
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_a_fit_resumes_from_the_release_checkpoint(tmp_path):
    checkpoint = _release()
    assert checkpoint["global_step"] == 2
    model = DINO(**{k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")})
    restored = _RestoredWeights()
    trainer = L.Trainer(
        # The release stopped at max_steps=2 with its epoch's last batch marked done: the resume opens epoch 1.
        max_epochs=2,
        max_steps=3,  # one step past the release's 2
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[restored],
        default_root_dir=tmp_path,
    )
    # The release trained on the quickstart's 2,000 images through the resumable loader, whose position (mid-epoch)
    # the checkpoint holds: the resumed loader must have as many items.
    trainer.fit(model, resumable_loader(RandomCrops(2000), 4, collate_train), ckpt_path=RELEASE_CKPT)
    for key, tensor in checkpoint["state_dict"].items():
        assert torch.equal(restored.state[key], tensor), key
    assert trainer.global_step == 3
    student = "student.backbone.blocks.0.attn.qkv.weight"
    assert not torch.equal(model.state_dict()[student], checkpoint["state_dict"][student])
