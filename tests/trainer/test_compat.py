"""What the last release (commit 42a0f7d) wrote still works after ssl_xcit.trainer took the run machinery out of
ssl_xcit.dino: the class paths its recipes and saved configs name, and its checkpoint (load, export, resume).

The fixture is that release's ``ssl-xcit fit -c recipes/quickstart.yaml`` with a 1-block, 32-wide XCiT and iBOT
on (2 optimiser steps, batch 4)."""

from __future__ import annotations

import importlib
from pathlib import Path

import jsonargparse
import lightning as L
import pytest
import torch
from conftest import RandomCrops

from ssl_xcit.cli.export import main as export_main
from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.resumable import resumable_loader
from ssl_xcit.dino.module import DINO
from ssl_xcit.models.checkpoint import read_checkpoint
from ssl_xcit.models.export import read_safetensors

RELEASE_CKPT = Path(__file__).resolve().parents[1] / "fixtures" / "release_42a0f7d_dino_ibot.ckpt"

# The class paths the release's recipes and saved configs name, and where the classes live now.
OLD_CLASS_PATHS = {
    "ssl_xcit.dino.callbacks.OnlineKNN": "ssl_xcit.trainer.callbacks.OnlineKNN",
    "ssl_xcit.dino.progress.SyncedRichProgressBar": "ssl_xcit.trainer.progress.SyncedRichProgressBar",
}


def _resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# The compatibility modules at the old paths: ssl_xcit/dino/callbacks.py and ssl_xcit/dino/progress.py.
@pytest.mark.parametrize("old, new", sorted(OLD_CLASS_PATHS.items()))
def test_old_class_paths_are_the_new_classes(old, new):
    assert _resolve(old) is _resolve(new)


def test_a_config_naming_the_old_callback_path_builds_the_new_class():
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callback", type=L.Callback)
    config = parser.parse_args(
        ['--callback={"class_path": "ssl_xcit.dino.callbacks.OnlineKNN", "init_args": {"k": 5}}']
    )
    callback = parser.instantiate_classes(config).callback
    assert type(callback) is _resolve("ssl_xcit.trainer.callbacks.OnlineKNN") and callback.k == 5


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
