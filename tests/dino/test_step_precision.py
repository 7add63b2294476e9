"""The step's math (``compute_losses``: DINO with both centrings, KoLeo, iBOT) under CPU bf16 autocast.

Under ``bf16-mixed`` the networks compute in bfloat16: their outputs carry its rounding, as in DINOv2 (whose
FSDP mixed precision computes in bfloat16 too). Everything after the networks must not add any: each loss is
recomputed here in float64 from the very outputs the networks gave under autocast, and the step's values, its
KoLeo neighbours and its teacher targets' argmax must be float32's.

Tolerance: float32 loses about 6e-8 relative per operation; over the few dozen exp/log/sum steps of these losses
(K = 64 prototypes, 3 Sinkhorn rounds, batches of 16) that stays well below 1e-5. One bfloat16 rounding
anywhere (8-bit significand: 2^-9 = 2e-3 relative) would be 200 times larger, so ``rel=1e-5`` tells them
apart. KoLeo's neighbours are compared exactly with those of float64 similarities of the float32 unit rows;
its loss with float64's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ssl_xcit.dino.koleo as koleo_module
import ssl_xcit.dino.step as step_module
from ssl_xcit.dino.step import compute_losses

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _sinkhorn64(scores: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """Sinkhorn-Knopp in float64: prototypes to 1/K of the batch, then samples to 1/B, rows summing to 1."""
    q = torch.exp(scores - scores.max())
    b, k = q.shape
    q = q / q.sum()
    for _ in range(iterations):
        q = q / q.sum(0, keepdim=True) / k
        q = q / q.sum(1, keepdim=True) / b
    return q * b


def _targets64(loss_fn, teacher: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    temp = loss_fn.teacher_temp_at(0)
    if loss_fn.centering == "sinkhorn_knopp":
        return _sinkhorn64(teacher / temp)
    return torch.softmax((teacher - center) / temp, dim=-1)


def _koleo64(x: torch.Tensor) -> float:
    x = F.normalize(x.double(), dim=1)
    d = torch.cdist(x, x).fill_diagonal_(torch.inf)
    return float(-torch.log(d.min(dim=1).values).mean())


class Recorder:
    """What the step's math saw and made: the losses' inputs, targets, KoLeo's inputs and neighbours."""

    def __init__(self, model, monkeypatch) -> None:
        self.inputs, self.targets, self.koleo, self.nearest = {}, {}, [], []
        for name in ("dino_loss", "ibot_loss"):
            loss_fn = getattr(model, name)
            loss_fn.register_forward_pre_hook(self._inputs(name))
            original = loss_fn.targets
            monkeypatch.setattr(loss_fn, "targets", self._targets(name, original))
        koleo, nearest = step_module.koleo_loss, koleo_module.nearest_neighbours
        monkeypatch.setattr(step_module, "koleo_loss", lambda x: self.koleo.append(x.detach()) or koleo(x))
        monkeypatch.setattr(
            koleo_module, "nearest_neighbours", lambda x: self._keep(self.nearest, nearest(x))
        )

    def _inputs(self, name):
        def hook(module, args):
            self.inputs[name] = [a.detach().clone() if torch.is_tensor(a) else a for a in args]

        return hook

    def _targets(self, name, original):
        return lambda teacher, epoch: self._keep(self.targets.setdefault(name, []), original(teacher, epoch))

    @staticmethod
    def _keep(store: list, value: torch.Tensor) -> torch.Tensor:
        store.append(value.detach().clone())
        return value


@pytest.mark.parametrize("centering", ["ema", "sinkhorn_knopp"])
def test_compute_losses_under_bf16_autocast_is_float32_after_the_networks(tiny, monkeypatch, centering):
    torch.manual_seed(0)
    model = tiny.model(
        drop_path_rate=0.0, koleo_weight=0.1, ibot_loss_weight=1.0, centering=centering, center_momentum=0.8
    )
    with torch.no_grad():  # an EMA centre that is not zero, so centring is exercised
        model.dino_loss.center.normal_(), model.ibot_loss.center.normal_()
    centres = {name: getattr(model, name).center.clone().double() for name in ("dino_loss", "ibot_loss")}
    # A near-collapsed batch (one image plus a little noise each), the regime KoLeo exists for: under bf16 its
    # embeddings' similarities would tie.
    g = torch.Generator().manual_seed(1)
    image = torch.randn(1, 3, 16, 16, generator=g)
    crops = [(image + 0.01 * torch.randn(16, 3, 16, 16, generator=g))[..., :s, :s] for s in (16, 16, 8, 8)]
    masks = model.draw_masks(crops[0], [0, 0, 0, 0])
    rec = Recorder(model, monkeypatch)
    with torch.autocast(**BF16):
        out = compute_losses(model, crops, masks, epoch=0, update_center=True)
        for name in ("dino_loss", "ibot_loss"):
            getattr(model, name).apply_center()
    assert rec.inputs["dino_loss"][0].dtype == torch.bfloat16  # the networks did run in bf16

    # DINO term: float64 targets from the same teacher logits, cross-entropy over all view pairs.
    student, teacher = (t.double() for t in rec.inputs["dino_loss"][:2])
    targets = _targets64(model.dino_loss, teacher, centres["dino_loss"])
    assert torch.equal(rec.targets["dino_loss"][0].argmax(1), targets.argmax(1))
    torch.testing.assert_close(rec.targets["dino_loss"][0].double(), targets, rtol=1e-5, atol=1e-7)
    logp = torch.log_softmax(student / 0.1, dim=1).chunk(4)
    pairs = [(-q * logp[v]).sum(1).mean() for i, q in enumerate(targets.chunk(2)) for v in range(4) if v != i]
    assert out.dino.loss.dtype == torch.float32
    assert float(out.dino.loss) == pytest.approx(float(sum(pairs) / len(pairs)), rel=1e-5)
    mean = targets.mean(0)
    kl = float((mean * mean.log()).sum() + np.log(64))
    assert float(out.dino.kl_to_uniform) == pytest.approx(kl, rel=1e-4, abs=1e-6)

    # iBOT term: the same at the masked patches, a per-image mean.
    p_student, p_teacher = (t.double() for t in rec.inputs["ibot_loss"][:2])
    p_targets = _targets64(model.ibot_loss, p_teacher, centres["ibot_loss"])
    assert torch.equal(rec.targets["ibot_loss"][0].argmax(1), p_targets.argmax(1))
    per_patch = (-p_targets * torch.log_softmax(p_student / 0.1, dim=1)).sum(1)
    ibot = float((per_patch * masks.weights.double()).sum() / masks.n_images)
    assert float(out.ibot.loss) == pytest.approx(ibot, rel=1e-5)

    # KoLeo: exact neighbours and float64's loss, per global crop.
    assert len(rec.koleo) == 2 and len(rec.nearest) == 2
    for embedding, nearest in zip(rec.koleo, rec.nearest, strict=True):
        unit = F.normalize(embedding.float(), dim=1).double()
        assert torch.equal(nearest, (unit @ unit.T).fill_diagonal_(-2.0).argmax(1))
    assert float(out.koleo) == pytest.approx(sum(_koleo64(e) for e in rec.koleo), rel=1e-5)
    assert float(out.total) == pytest.approx(float(out.dino.loss + 0.1 * out.koleo + out.ibot.loss), rel=1e-6)

    # EMA centres: one step towards the mean teacher row, in float32.
    for name, logits in (("dino_loss", teacher), ("ibot_loss", p_teacher)):
        centre = getattr(model, name).center
        assert centre.dtype == torch.float32
        if centering == "ema":
            expected = 0.8 * centres[name] + 0.2 * logits.mean(0, keepdim=True)
            torch.testing.assert_close(centre.double(), expected, rtol=1e-5, atol=1e-6)
        else:  # Sinkhorn-Knopp has no centre
            assert torch.equal(centre.double(), centres[name])
