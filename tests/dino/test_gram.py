"""DINOv3's Gram anchoring (``ssl_xcit.dino.gram``): the loss against a float64 formula, its chunking, the Gram
teacher's schedule, sources and resume, settings errors, and the term inside DINO's step for each family."""

from __future__ import annotations

import itertools

import lightning as L
import pytest
import torch

from ssl_xcit.dino.gram import gram_loss, resize_patches
from ssl_xcit.errors import UserError


def reference_gram_loss(student, teacher, remove_negative=False):
    """DINOv3's definition written out in float64: per image, the cosine similarity of every patch pair for
    student and teacher (negatives set to 0 if asked), the mean of the squared differences over all entries."""
    s, t = student.double(), teacher.double()
    n_images, n_tokens = s.shape[:2]
    total = s.new_zeros(())
    for b, i, j in itertools.product(range(n_images), range(n_tokens), range(n_tokens)):
        cos_s = (s[b, i] * s[b, j]).sum() / (s[b, i].norm() * s[b, j].norm())
        cos_t = (t[b, i] * t[b, j]).sum() / (t[b, i].norm() * t[b, j].norm())
        if remove_negative:
            cos_s, cos_t = cos_s.clamp_min(0.0), cos_t.clamp_min(0.0)
        total = total + (cos_s - cos_t) ** 2
    return total / (n_images * n_tokens * n_tokens)


@pytest.mark.parametrize("remove_negative", [False, True])
@pytest.mark.parametrize("chunk_bytes", [2**30, 4 * 6 * 6], ids=["one-chunk", "image-chunks"])
def test_loss_and_gradient_match_a_float64_formula(remove_negative, chunk_bytes):
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64)
    teacher = torch.randn(3, 6, 7, generator=gen, dtype=torch.float64)  # another width: only N x N meets
    ours_in = student.float().requires_grad_()
    ref_in = student.clone().requires_grad_()
    ours = gram_loss(ours_in, teacher.float(), remove_negative, chunk_bytes=chunk_bytes)
    ref = reference_gram_loss(ref_in, teacher, remove_negative)
    ours.backward()
    ref.backward()
    assert ours.dtype == torch.float32
    assert abs(float(ours) - float(ref)) < 1e-6
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, atol=1e-6, rtol=1e-5)


def test_loss_exact_values_on_constructed_features():
    same = torch.tensor([[[1.0, 0.0], [2.0, 0.0]]])  # one direction: every similarity 1
    orthogonal = torch.tensor([[[1.0, 0.0], [0.0, 3.0]]])  # identity Gram
    opposite = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])  # off-diagonal -1
    assert float(gram_loss(same, orthogonal)) == 0.5  # two off-diagonal entries of 1 over 4
    assert float(gram_loss(same, opposite)) == 2.0  # two entries of (1 - -1)^2 = 4 over 4
    assert float(gram_loss(same, opposite, remove_negative=True)) == 0.5  # -1 counts as 0
    assert float(gram_loss(opposite, opposite)) == 0.0


def test_bfloat16_features_are_scored_in_float32():
    gen = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 8, 4, generator=gen), torch.randn(2, 8, 4, generator=gen)
    low = gram_loss(student.bfloat16(), teacher.bfloat16())
    assert low.dtype == torch.float32
    ref = reference_gram_loss(student.bfloat16().float(), teacher.bfloat16().float())
    assert abs(float(low) - float(ref)) < 1e-6


def test_resize_is_bicubic_to_the_student_grid_and_keeps_constants():
    tokens = torch.randn(2, 8 * 6, 3)
    out = resize_patches(tokens, (8, 6), (4, 3))
    maps = tokens.transpose(1, 2).reshape(2, 3, 8, 6)
    expected = torch.nn.functional.interpolate(maps, size=(4, 3), mode="bicubic", align_corners=False)
    torch.testing.assert_close(out, expected.flatten(2).transpose(1, 2))
    constant = torch.full((1, 16, 2), 0.7)
    torch.testing.assert_close(resize_patches(constant, (4, 4), (2, 2)), torch.full((1, 4, 2), 0.7))
    torch.testing.assert_close(resize_patches(tokens, (8, 6), (8, 6)), tokens)


def tiny(**overrides):
    from conftest import tiny_model

    return tiny_model(**overrides)


def _params(module):
    """Weights and BatchNorm statistics (a train-mode forward only counts up ``num_batches_tracked``, which does
    nothing at the Gram teacher's momentum of 0)."""
    return [
        v.detach().clone() for k, v in module.state_dict().items() if not k.endswith("num_batches_tracked")
    ]


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_snapshot_then_refreshes_on_schedule():
    model = tiny(gram_loss_weight=2.0, gram_start_step=3, gram_refresh_every=2, gram_max_refreshes=1)
    gram, teacher = model.gram_teacher, model.teacher.backbone

    def nudge():  # the EMA teacher moves between steps
        with torch.no_grad():
            for p in teacher.parameters():
                p.add_(0.01)

    nudge()
    gram.update(teacher, 2)
    assert not gram.initialised and gram.weight_at(2) == 0.0
    assert not _equal(_params(gram.backbone), _params(teacher))
    gram.update(teacher, 3)  # the snapshot
    snapshot = _params(gram.backbone)
    assert gram.initialised and gram.weight_at(3) == 2.0 and _equal(snapshot, _params(teacher))
    nudge()
    gram.update(teacher, 4)  # not due: 3 + 2
    assert _equal(_params(gram.backbone), snapshot)
    gram.update(teacher, 5)  # the refresh
    assert gram.refreshes == 1 and _equal(_params(gram.backbone), _params(teacher))
    nudge()
    gram.update(teacher, 7)  # max_refreshes reached
    assert gram.refreshes == 1 and not _equal(_params(gram.backbone), _params(teacher))
    assert not any(p.requires_grad for p in gram.parameters())


def test_a_checkpoint_source_is_read_with_the_weights_loader(tmp_path):
    from ssl_xcit.models import create_model

    source = create_model("xcit_nano_12_p8", depth=1)
    torch.save(
        {"state_dict": {f"teacher.backbone.{k}": v for k, v in source.state_dict().items()}},
        tmp_path / "gram.ckpt",
    )
    model = tiny(gram_loss_weight=1.0, gram_teacher=str(tmp_path / "gram.ckpt"), ibot_loss_weight=1.0)
    model.gram_teacher.update(model.teacher.backbone, 0)
    assert _equal(_params(model.gram_teacher.backbone), _params(source))
    other = create_model("vit_tiny_patch16_224", depth=1)
    torch.save(other.state_dict(), tmp_path / "vit.pth")
    wrong = tiny(gram_loss_weight=1.0, gram_teacher=str(tmp_path / "vit.pth"))
    with pytest.raises(UserError, match="vit"):
        wrong.gram_teacher.update(wrong.teacher.backbone, 0)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(gram_loss_weight=-1.0), "gram_loss_weight must be >= 0"),
        (dict(gram_loss_weight=1.0, gram_resolution_scale=3), "gram_resolution_scale must be 1 or 2"),
        (dict(gram_loss_weight=1.0, gram_start_step=-5), "gram_start_step must be an integer >= 0"),
        (dict(gram_loss_weight=1.0, gram_refresh_every=1.5), "gram_refresh_every must be an integer"),
        (
            dict(gram_loss_weight=1.0, gram_teacher="/nonexistent/gram.ckpt"),
            "gram_teacher checkpoint not found",
        ),
        (
            dict(gram_loss_weight=1.0, backbone="bixt_ti_l64_p16", backbone_kwargs={"depth": 2}),
            "Gram anchoring needs .* bixt backbones .*xcit, vit, cait",
        ),
    ],
)
def test_bad_settings_are_one_line_user_errors(overrides, match):
    with pytest.raises(UserError, match=match) as err:
        tiny(**overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("backbone", ["xcit_nano_12_p8", "vit_tiny_patch16_224", "cait_xxs24"])
@pytest.mark.parametrize("ibot, scale", [(False, 2), (True, 1)])
def test_the_step_adds_the_weighted_term_for_each_family(backbone, ibot, scale):
    torch.manual_seed(0)
    model = tiny(
        backbone=backbone,
        drop_path_rate=0.0,
        gram_loss_weight=3.0,
        ibot_loss_weight=1.0 if ibot else 0.0,
        gram_resolution_scale=scale,
    )
    crops = [torch.randn(2, 3, s, s) for s in (32, 32, 16, 16)]
    masks = model.draw_masks(crops[0], [0, 0, 0, 0]) if ibot else None
    off = model.compute_losses(crops, masks, 0, update_center=False)
    assert off.gram is None  # before the Gram teacher is taken
    model._update_gram_teacher(0)
    on = model.compute_losses(crops, masks, 0, update_center=False)
    assert on.gram is not None and float(on.gram) >= 0
    torch.testing.assert_close(on.total, off.total + 3.0 * on.gram)
    # The term alone reaches the student's backbone, never the Gram teacher.
    model.student.zero_grad()
    on.gram.backward()
    grads = [p.grad for p in model.student.backbone.parameters() if p.grad is not None]
    assert model.gram_teacher is not None and all(p.grad is None for p in model.gram_teacher.parameters())
    if scale == 2 or ibot:  # the teacher's features differ from the student's: a non-zero gradient
        assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    # The student's patches of the masked pass, as DINOv3; at scale 2 the teacher sees 2x the tokens.
    grid = model.student.backbone.token_grid(32, 32)
    teacher_grid = model.gram_teacher.backbone.token_grid(32 * scale, 32 * scale)
    assert teacher_grid == (grid[0] * scale, grid[1] * scale)


class _GramState(L.Callback):
    """The Gram teacher's weights and counters at the end of each step of a run."""

    def __init__(self):
        self.states = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        g = pl_module.gram_teacher
        self.states.append(
            (
                trainer.global_step,
                g.initialised,
                g.refreshes,
                _params(g.backbone),
                _params(pl_module.teacher.backbone),
            )
        )


def test_resume_restores_the_gram_teacher_and_its_refresh_count(tmp_path):
    from conftest import tiny_loader, tiny_trainer

    opts = dict(gram_loss_weight=1.0, gram_start_step=1, gram_refresh_every=2, gram_max_refreshes=1)
    first, record = tiny(**opts), _GramState()
    trainer = tiny_trainer(tmp_path, max_epochs=1, callbacks=[record])
    trainer.fit(first, tiny_loader(n=16, batch_size=4))  # 4 steps: snapshot before step 1, refresh before 3
    assert "train/gram_loss" in trainer.callback_metrics
    step, initialised, refreshes, saved, ema = record.states[-1]
    assert (step, initialised, refreshes) == (4, True, 1) and not _equal(saved, ema)

    resumed, after = tiny(**opts), _GramState()
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[after])
    trainer.fit(resumed, tiny_loader(n=16, batch_size=4), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    step, initialised, refreshes, weights, _ = after.states[0]
    assert (step, initialised, refreshes) == (5, True, 1)
    assert _equal(weights, saved)  # the saved Gram teacher, neither the EMA teacher nor a new snapshot


def test_a_run_switches_the_term_on_or_off_when_it_resumes(tmp_path):
    """DINOv3 switches Gram anchoring on late in a run: a checkpoint without the term resumes with it (the
    snapshot comes at gram_start_step, from the restored EMA teacher), and one with it resumes without it."""
    from conftest import tiny_loader, tiny_trainer

    tiny_trainer(tmp_path, max_epochs=1).fit(tiny(), tiny_loader(n=16, batch_size=4))  # 4 steps, no Gram
    on, record = tiny(gram_loss_weight=1.0, gram_start_step=5), _GramState()
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[record])
    trainer.fit(on, tiny_loader(n=16, batch_size=4), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert [(s[0], s[1]) for s in record.states] == [(5, False), (6, True), (7, True), (8, True)]
    assert "train/gram_loss" in trainer.callback_metrics

    off = tiny()
    trainer = tiny_trainer(tmp_path, max_epochs=3)
    trainer.fit(off, tiny_loader(n=16, batch_size=4), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert trainer.global_step == 12 and off.gram_teacher is None
