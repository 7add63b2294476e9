"""Training with ``augment_on="device"``: seeded runs repeat exactly and resume is exact at epoch boundaries."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from PIL import Image

from ssl_xcit.data.datamodule import DINODataModule


def make_tree(root: Path) -> str:
    rng = np.random.default_rng(0)
    for name in ("ant", "bee"):
        (root / name).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(root / name / f"{i}.jpg")
    return str(root)


def fit(tiny, root: str, tmp_path: Path, ckpt_path=None, callbacks=(), seed: int = 0, augment_on="device"):
    L.seed_everything(seed)
    dm = DINODataModule(
        root=root, batch_size=4, num_workers=0, global_crops_size=16, local_crops_size=8, local_crops_number=2,
        augment_on=augment_on,
    )  # fmt: skip
    model = tiny.model()
    trainer = tiny.trainer(tmp_path, max_epochs=2, callbacks=callbacks)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_seeded_runs_repeat_and_differ_across_seeds(tiny, tmp_path):
    root = make_tree(tmp_path / "data")
    rec_a, rec_b, rec_c = tiny.Recorder(), tiny.Recorder(), tiny.Recorder()
    a, _ = fit(tiny, root, tmp_path / "a", callbacks=[rec_a])
    b, _ = fit(tiny, root, tmp_path / "b", callbacks=[rec_b])
    fit(tiny, root, tmp_path / "c", callbacks=[rec_c], seed=1)
    assert len(rec_a.losses) == 8 and rec_a.losses == rec_b.losses
    assert_same_weights(a, b)
    assert rec_a.losses != rec_c.losses


def test_resume_at_epoch_boundary_is_exact(tiny, tmp_path):
    root = make_tree(tmp_path / "data")
    full, trainer = fit(tiny, root, tmp_path / "full")
    fit(tiny, root, tmp_path / "resumed", callbacks=[tiny.Recorder(stop_after_epoch=0)])
    last = tmp_path / "resumed" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["DINODataModule"] == {"augment_seed": 0}
    resumed, trainer2 = fit(tiny, root, tmp_path / "resumed", ckpt_path=str(last))
    assert trainer.global_step == trainer2.global_step == 8
    assert_same_weights(full, resumed)
