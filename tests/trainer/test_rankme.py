"""RankMe, the label-free monitor: the formula against numpy on matrices of known rank, the Gram route against the
direct one, and the callback in a run (its values equal the formula applied to the teacher's embeddings)."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from ssl_xcit.errors import UserError
from ssl_xcit.trainer.rankme import RankMe, held_out_grams, rankme, rankme_from_gram


def numpy_rankme(x: np.ndarray, eps: float = 1e-7) -> float:
    """Independent: singular values from the eigenvalues of the N x N Gram matrix X X^T (the other side from the
    module's D x D), the entropy in numpy."""
    eig = np.clip(np.linalg.eigvalsh(x @ x.T), 0, None)
    sigma = np.sqrt(np.sort(eig)[::-1][: min(x.shape)])
    p = sigma / sigma.sum() + eps
    return float(np.exp(-(p * np.log(p)).sum()))


def matrix_of_rank(n: int, d: int, singular_values: list[float], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((n, n)))
    v, _ = np.linalg.qr(rng.standard_normal((d, d)))
    s = np.zeros((n, d))
    s[range(len(singular_values)), range(len(singular_values))] = singular_values
    return u @ s @ v.T


@pytest.mark.parametrize("rank", [1, 3, 17])
def test_equal_singular_values_give_the_rank(rank):
    x = matrix_of_rank(40, 24, [2.5] * rank)
    assert numpy_rankme(x) == pytest.approx(rank, rel=1e-4)
    assert rankme(torch.from_numpy(x)) == pytest.approx(rank, rel=1e-4)
    t = torch.from_numpy(x)
    assert rankme_from_gram(t.T @ t, rows=40) == pytest.approx(rank, rel=1e-4)


@pytest.mark.parametrize(("n", "d"), [(50, 16), (10, 16)])  # more rows than columns, and fewer
def test_unequal_spectrum_matches_numpy(n, d):
    x = matrix_of_rank(n, d, list(np.geomspace(10, 0.01, min(n, d))), seed=1)
    expected = numpy_rankme(x)
    assert 1 < expected < min(n, d) - 1  # neither degenerate nor flat: the entropy matters
    t = torch.from_numpy(x).float()  # float32 embeddings, as the backbone gives
    assert rankme(t) == pytest.approx(expected, rel=1e-4)
    assert rankme_from_gram(t.double().T @ t.double(), rows=n) == pytest.approx(expected, rel=1e-4)


def test_collapsed_embeddings_have_rank_near_one():
    rng = np.random.default_rng(2)
    point = rng.standard_normal(32)
    x = point + 1e-4 * rng.standard_normal((64, 32))  # every image maps to (nearly) one point
    assert numpy_rankme(x) < 1.05 and rankme(torch.from_numpy(x)) == pytest.approx(numpy_rankme(x), rel=1e-4)
    assert rankme(torch.zeros(5, 4)) == 1.0


class Images(Dataset):
    def __init__(self, n: int = 10, side: int = 16) -> None:
        g = torch.Generator().manual_seed(3)
        self.images = torch.randn(n, 3, side, side, generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], -1  # unlabelled


def test_held_out_grams_equal_the_embeddings_gram_and_restore_modes(tiny):
    backbone = tiny.model().teacher.backbone
    backbone.train()
    data = Images()
    grams = held_out_grams(backbone, data, torch.device("cpu"), batch_size=4)
    assert all(m.training for m in backbone.modules())  # the train mode came back
    backbone.eval()
    with torch.no_grad():
        cls, patches = backbone.forward_cls_patches(data.images)
    gram, rows = grams["embedding"]
    assert rows == 10
    torch.testing.assert_close(gram, cls.double().T @ cls.double(), rtol=1e-5, atol=1e-6)
    flat = patches.reshape(-1, patches.shape[-1]).numpy().astype(np.float64)
    assert grams["patch"][1] == flat.shape[0] == 10 * 4  # 16 px of 8-px patches: 2 x 2 tokens per image
    assert rankme_from_gram(*grams["patch"]) == pytest.approx(numpy_rankme(flat), rel=1e-4)
    assert rankme_from_gram(gram, rows) == pytest.approx(
        numpy_rankme(cls.numpy().astype(np.float64)), rel=1e-4
    )


class HeldOut(L.LightningDataModule):
    def __init__(self, tiny, heldout: Dataset | None) -> None:
        super().__init__()
        self.tiny, self.heldout = tiny, heldout

    def train_dataloader(self):
        return self.tiny.loader(8)

    def heldout_dataset(self):
        return self.heldout


def test_callback_logs_the_teachers_rankme_at_start_and_epoch_end(tiny, tmp_path):
    data = Images(n=12)
    monitor = RankMe(max_images=10, batch_size=4)  # 10 of 12, evenly spaced
    model = tiny.model()
    start = {k: v.clone() for k, v in model.teacher.backbone.state_dict().items()}
    trainer = tiny.trainer(tmp_path, max_epochs=1, callbacks=[monitor])
    trainer.fit(model, datamodule=HeldOut(tiny, data))
    assert [h["step"] for h in monitor.history] == [0, trainer.global_step]
    kept = data.images[[int(i * 1.2) for i in range(10)]]
    for entry, weights in ((monitor.history[0], start), (monitor.history[-1], None)):
        backbone = tiny.model().teacher.backbone
        backbone.load_state_dict(weights or model.teacher.backbone.state_dict())
        with torch.no_grad():
            cls, patches = backbone.eval().forward_cls_patches(kept)
        assert entry["embedding"] == pytest.approx(numpy_rankme(cls.double().numpy()), rel=1e-4)
        flat = patches.reshape(-1, patches.shape[-1]).double().numpy()
        assert entry["patch"] == pytest.approx(numpy_rankme(flat), rel=1e-4)
    assert monitor.history[0]["embedding"] != monitor.history[-1]["embedding"]  # the teacher moved
    assert trainer.callback_metrics["rankme/embedding"] == pytest.approx(monitor.history[-1]["embedding"])


def test_callback_without_held_out_images_says_so_and_training_goes_on(tiny, tmp_path):
    monitor = RankMe()
    trainer = tiny.trainer(tmp_path, max_epochs=1, callbacks=[monitor])
    with pytest.warns(UserWarning, match=r"RankMe monitor disabled: no held-out images .*val_fraction"):
        trainer.fit(tiny.model(), datamodule=HeldOut(tiny, None))
    assert monitor.history == [] and trainer.global_step == 2
    with pytest.raises(UserError, match="max_images must be >= 2"):
        RankMe(max_images=1)
