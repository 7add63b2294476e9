"""DINOv3's Gram anchoring (``ssl_xcit.dino.gram``): the loss against a float64 formula, its chunking, the Gram
teacher's sources and resume, settings errors, the term inside DINO's step for each family and on the Gram
teacher's own crops, and the one-line errors for a batch without them (schedule: ``test_gram_schedule.py``)."""

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


def _teacher_differs(model):
    """``model`` with its teacher moved away from its student, so a source read from the wrong side shows."""
    with torch.no_grad():
        for p in model.teacher.backbone.parameters():
            p.add_(0.5)
    return model


def _our_ckpt(path):
    source = _teacher_differs(tiny(ibot_loss_weight=1.0))  # its teacher has no mask token, its student does
    torch.save({"state_dict": source.state_dict()}, path)
    return source.teacher.backbone.state_dict()


def _official_full(path):
    source = _teacher_differs(tiny())
    sides = {
        side: {f"module.{k}": v for k, v in getattr(source, side).state_dict().items()}
        for side in ("student", "teacher")
    }
    torch.save({**sides, "dino_loss": {"center": torch.zeros(1, 64)}, "epoch": 3}, path)
    return source.teacher.backbone.state_dict()


@pytest.mark.parametrize("write", [_our_ckpt, _official_full], ids=["our-ckpt", "official-full"])
def test_a_fixed_gram_teacher_is_the_sources_teacher_backbone(write, tmp_path):
    from ssl_xcit.dino.gram import read_gram_source

    want = write(tmp_path / "gram.pth")
    model = tiny(gram_loss_weight=1.0, gram_start_step=2, gram_teacher=str(tmp_path / "gram.pth"))
    assert not model.gram_teacher.initialised
    read_gram_source(model)
    gram = model.gram_teacher
    assert gram.initialised and gram.weight_at(1) == 0.0 and gram.weight_at(2) == 1.0
    for key, value in gram.backbone.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)
    gram.update(model.teacher.backbone, 2)  # start_step: the source stays, no snapshot of the EMA teacher
    assert _equal(
        _params(gram.backbone), [want[k] for k in gram.backbone.state_dict() if "num_batches" not in k]
    )


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_a_fixed_gram_teacher_from_timm_weights_in_a_local_file(tmp_path):
    import timm
    from safetensors.torch import save_file

    from ssl_xcit.dino.gram import read_gram_source

    torch.manual_seed(6)
    released = timm.create_model("xcit_nano_12_p16_224", num_classes=1000)  # as timm's hub stores it
    save_file(released.state_dict(), tmp_path / "model.safetensors")
    source = f"timm:xcit_nano_12_p16_224.fb_in1k@{tmp_path / 'model.safetensors'}"
    model = tiny(backbone="xcit_nano_12_p16", backbone_kwargs={}, gram_loss_weight=1.0, gram_teacher=source)
    read_gram_source(model)
    want = released.state_dict()
    for key, value in model.gram_teacher.backbone.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def test_a_gram_teacher_that_does_not_fit_is_one_line(tmp_path):
    from ssl_xcit.dino.gram import read_gram_source
    from ssl_xcit.models import create_model

    torch.save(create_model("vit_tiny_patch16_224", depth=1).state_dict(), tmp_path / "vit.pth")
    for source, expected in [
        (
            tmp_path / "vit.pth",
            f"--model.gram_teacher {tmp_path / 'vit.pth'} does not fit the Gram teacher backbone "
            "xcit_nano_12_p8 with depth=1: missing [",
        ),
        (tmp_path / "gone.ckpt", f"--model.gram_teacher {tmp_path / 'gone.ckpt'}: file not found"),
        (
            "timm:vit_tiny_patch16_224",
            "--model.gram_teacher timm:vit_tiny_patch16_224 holds a vit_tiny_patch16_224",
        ),
    ]:
        model = tiny(gram_loss_weight=1.0, gram_teacher=str(source))  # construction never reads it
        with pytest.raises(UserError) as err:
            read_gram_source(model)
        assert "\n" not in str(err.value) and expected in str(err.value)
        assert not model.gram_teacher.initialised


@pytest.mark.slow  # ~15 s: two fits and a resume (the suite's time budget)
def test_a_resumed_run_needs_no_gram_teacher_file(tmp_path):
    """The fixed Gram teacher is read at a fresh fit's start and rides the checkpoints: neither
    ``DINO.load_from_checkpoint`` nor a resumed fit reads the file, which may be gone."""
    from conftest import tiny_loader, tiny_trainer

    from ssl_xcit.dino.module import DINO

    want = _our_ckpt(tmp_path / "gram.ckpt")
    opts = dict(gram_loss_weight=1.0, gram_start_step=1, gram_teacher=str(tmp_path / "gram.ckpt"))
    record = _GramState()
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[record]).fit(
        tiny(**opts), tiny_loader(n=8, batch_size=4, gram_scale=1)
    )
    source = [want[k] for k in tiny(**opts).gram_teacher.backbone.state_dict() if "num_batches" not in k]
    assert [s[:2] for s in record.states] == [(1, True), (2, True)] and _equal(record.states[-1][3], source)
    (tmp_path / "gram.ckpt").unlink()

    last = str(tmp_path / "ckpt" / "last.ckpt")
    loaded = DINO.load_from_checkpoint(last)
    assert loaded.gram_teacher.initialised and _equal(_params(loaded.gram_teacher.backbone), source)
    after = _GramState()
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[after])
    trainer.fit(tiny(**opts), tiny_loader(n=8, batch_size=4, gram_scale=1), ckpt_path=last)
    assert [s[:2] for s in after.states] == [(3, True), (4, True)] and _equal(after.states[0][3], source)


def _gram_crops(crops, scale, seed=5):
    """Gram teacher crops of the global crops' shape at ``scale`` x their side, of other content than theirs,
    so a term computed from the global crops shows."""
    b, c, h, w = crops[0].shape
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, c, h * scale, w * scale, generator=gen) for _ in range(2)]


def test_the_term_is_computed_on_the_gram_teachers_own_crops():
    """Gram loss = an independent float64 computation: the student's patch tokens of its global crops, the Gram
    teacher's of its own crops (twice the side), resized bicubically to the student's grid."""
    torch.manual_seed(0)
    model = tiny(
        backbone="vit_tiny_patch16_224", drop_path_rate=0.0, gram_loss_weight=1.0, gram_resolution_scale=2
    )
    crops = [torch.randn(2, 3, s, s) for s in (32, 32, 16, 16)]
    gram_crops = _gram_crops(crops, 2)
    model._update_gram_teacher(0)
    with torch.no_grad():  # a student away from the snapshot
        for p in model.student.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = model.compute_losses(crops, None, 0, update_center=False, gram_crops=gram_crops)
    with torch.no_grad():
        _, student = model.student.backbone.forward_cls_patches(torch.cat(crops[:2]))
        _, teacher = model.gram_teacher.backbone.forward_cls_patches(torch.cat(gram_crops))
    maps = teacher.double().transpose(1, 2).reshape(4, -1, 4, 4)  # 64 px / 16: a 4 x 4 grid
    small = torch.nn.functional.interpolate(maps, size=(2, 2), mode="bicubic", align_corners=False)
    want = reference_gram_loss(student.double(), small.flatten(2).transpose(1, 2))
    assert abs(float(out.gram) - float(want)) < 1e-6 and float(want) > 1e-4
    from_globals = model.gram_teacher.backbone.forward_cls_patches(
        torch.nn.functional.interpolate(torch.cat(crops[:2]), scale_factor=2, mode="bicubic")
    )[1]
    assert not torch.allclose(
        from_globals, teacher
    )  # the old input (upsampled global crops) gives another term


def test_a_batch_without_the_gram_crops_the_model_needs_is_one_line():
    crops = [torch.randn(2, 3, s, s) for s in (32, 32, 16, 16)]
    anchored = tiny(gram_loss_weight=1.0, gram_resolution_scale=2)
    cases = [
        (anchored, None, r"needs 2 Gram teacher crops of shape \(2, 3, 64, 64\) .* got none; train with"),
        (
            anchored,
            _gram_crops(crops, 1),
            r"of shape \(2, 3, 64, 64\) .* got \[\(2, 3, 32, 32\), \(2, 3, 32, 32\)\]",
        ),
        (
            tiny(),
            _gram_crops(crops, 1),
            "the batch carries the Gram teacher's crops but the model does not anchor",
        ),
    ]
    for model, gram_crops, match in cases:
        with pytest.raises(UserError, match=match) as err:
            model.compute_losses(crops, None, 0, update_center=False, gram_crops=gram_crops)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(gram_loss_weight=-1.0), "gram_loss_weight must be >= 0"),
        (
            dict(gram_loss_weight=1.0, gram_resolution_scale=3),
            "gram_resolution_scale must be a number from 1 to 2.*3",
        ),
        (dict(gram_loss_weight=1.0, gram_resolution_scale=0.5), "gram_resolution_scale must be .* got 0.5"),
        (dict(gram_loss_weight=1.0, gram_start_step=-5), "gram_start_step must be an integer >= 0"),
        (dict(gram_loss_weight=1.0, gram_refresh_every=1.5), "gram_refresh_every must be an integer"),
        (
            dict(gram_loss_weight=1.0, gram_weight_warmup_steps=-1),
            "gram_weight_warmup_steps must be an integer",
        ),
        (dict(gram_loss_weight=1.0, gram_teacher=" "), "gram_teacher must be a SOURCE as --model.init_from"),
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
    gram_crops = _gram_crops(crops, scale)
    off = model.compute_losses(crops, masks, 0, update_center=False, gram_crops=gram_crops)
    assert off.gram is None  # before the Gram teacher is taken
    model._update_gram_teacher(0)
    on = model.compute_losses(crops, masks, 0, update_center=False, gram_crops=gram_crops)
    assert on.gram is not None and float(on.gram) >= 0
    torch.testing.assert_close(on.total, off.total + 3.0 * on.gram)
    # The term alone reaches the student's backbone, never the Gram teacher.
    model.student.zero_grad()
    on.gram.backward()
    grads = [p.grad for p in model.student.backbone.parameters() if p.grad is not None]
    assert model.gram_teacher is not None and all(p.grad is None for p in model.gram_teacher.parameters())
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)  # its own crops: other features
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


@pytest.mark.slow  # ~20 s: a fit and its resume (the suite's time budget)
def test_resume_restores_the_gram_teacher_and_its_refresh_count(tmp_path):
    from conftest import tiny_loader, tiny_trainer

    opts = dict(gram_loss_weight=1.0, gram_start_step=1, gram_refresh_every=2, gram_max_refreshes=1)
    first, record = tiny(**opts), _GramState()
    trainer = tiny_trainer(tmp_path, max_epochs=1, callbacks=[record])
    trainer.fit(
        first, tiny_loader(n=16, batch_size=4, gram_scale=1)
    )  # 4 steps: snapshot before 1, refresh before 2
    assert "train/gram_loss" in trainer.callback_metrics
    step, initialised, refreshes, saved, ema = record.states[-1]
    assert (step, initialised, refreshes) == (4, True, 1) and not _equal(saved, ema)

    resumed, after = tiny(**opts), _GramState()
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[after])
    trainer.fit(
        resumed, tiny_loader(n=16, batch_size=4, gram_scale=1), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    step, initialised, refreshes, weights, _ = after.states[0]
    assert (step, initialised, refreshes) == (5, True, 1)
    assert _equal(weights, saved)  # the saved Gram teacher, neither the EMA teacher nor a new snapshot


@pytest.mark.slow  # ~20 s: four fits (on, off, both ways)
def test_a_run_switches_the_term_on_or_off_when_it_resumes(tmp_path):
    """DINOv3 switches Gram anchoring on late in a run: a checkpoint without the term resumes with it (the
    snapshot comes at gram_start_step, from the restored EMA teacher), and one with it resumes without it."""
    from conftest import tiny_loader, tiny_trainer

    tiny_trainer(tmp_path, max_epochs=1).fit(tiny(), tiny_loader(n=16, batch_size=4))  # 4 steps, no Gram
    on, record = tiny(gram_loss_weight=1.0, gram_start_step=5), _GramState()
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[record])
    trainer.fit(
        on, tiny_loader(n=16, batch_size=4, gram_scale=1), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert [(s[0], s[1]) for s in record.states] == [(5, False), (6, True), (7, True), (8, True)]
    assert "train/gram_loss" in trainer.callback_metrics

    off = tiny()
    trainer = tiny_trainer(tmp_path, max_epochs=3)
    trainer.fit(off, tiny_loader(n=16, batch_size=4), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert trainer.global_step == 12 and off.gram_teacher is None


@pytest.mark.parametrize("spelling", ["init_from", pytest.param("the same path", marks=pytest.mark.slow)])
def test_gram_anchoring_to_the_init_from_source_itself(spelling, tmp_path):
    """Continued pretraining anchored to where it came from: ``gram_teacher: init_from`` (or init_from's own
    path) gives a Gram teacher equal to SOURCE's teacher backbone, held while the run's teacher moves away."""
    from conftest import tiny_loader, tiny_trainer

    path = tmp_path / "source.pth"
    want = _official_full(path)
    gram_teacher = "init_from" if spelling == "init_from" else str(path)
    model = tiny(
        init_from=str(path), gram_loss_weight=1.0, gram_teacher=gram_teacher, init_head_warmup_steps=0
    )
    record = _GramState()
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[record]).fit(
        model, tiny_loader(n=8, batch_size=4, gram_scale=1)
    )
    source = [want[k] for k in model.gram_teacher.backbone.state_dict() if "num_batches" not in k]
    assert all(s[1] for s in record.states) and _equal(record.states[-1][3], source)
    assert not _equal(_params(model.teacher.backbone), source)  # the EMA teacher moved; the anchor did not
    with pytest.raises(UserError, match="gram_teacher: init_from anchors to --model.init_from's SOURCE, but"):
        tiny(gram_loss_weight=1.0, gram_teacher="init_from")
