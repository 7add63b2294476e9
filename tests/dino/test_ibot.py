"""iBOT's masked patch term inside DINO: it trains for XCiT, ViT and CaiT, and weight 0 leaves DINO as it was."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.dino.collapse import CollapseGuard
from ssl_xcit.dino.module import DINO
from ssl_xcit.models.base import MaskingNotSupported

HEAD = dict(out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16)
FAMILIES = {
    "xcit_nano_12_p8": {"depth": 1},
    "vit_tiny_patch16_224": {"depth": 1},
    "cait_xxs24": {"depth": 1},
}


class Crops(Dataset):
    """2 global 32-px and 2 local 16-px crops per item."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(i)
        return [torch.randn(3, s, s, generator=gen) for s in (32, 32, 16, 16)], i % 2, i


def _fit(model: DINO, tmp_path, steps: int = 2) -> L.Trainer:
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(Crops(), batch_size=4))
    return trainer


@pytest.mark.parametrize("backbone", list(FAMILIES))
def test_ibot_trains_the_mask_token_and_patch_head(backbone, tmp_path):
    L.seed_everything(0)
    model = DINO(
        backbone,
        backbone_kwargs=FAMILIES[backbone],
        ibot_loss_weight=1.0,
        warmup_epochs=0,
        freeze_last_layer=0,
        lr=0.05,
        **HEAD,
    )
    token = model.student.backbone.mask_token.detach().clone()
    patch_head = model.student.patch_head.mlp[0].weight.detach().clone()
    teacher_patch_head = model.teacher.patch_head.mlp[0].weight.detach().clone()
    trainer = _fit(model, tmp_path)
    assert trainer.global_step == 2
    assert not torch.equal(model.student.backbone.mask_token, token)  # masked crops reached the loss
    assert not torch.equal(model.student.patch_head.mlp[0].weight, patch_head)
    assert not torch.equal(model.teacher.patch_head.mlp[0].weight, teacher_patch_head)  # EMA
    assert model.last_patch_collapse_signals is not None
    entropy, kl = model.last_patch_collapse_signals
    assert 0 <= entropy <= torch.log(torch.tensor(64.0)) + 1e-4 and kl >= -1e-6
    assert torch.isfinite(trainer.callback_metrics["train/ibot_loss"])


def test_shared_head_has_no_patch_head_and_checks_prototypes(tmp_path):
    L.seed_everything(0)
    model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, ibot_loss_weight=1.0, ibot_separate_head=False,
                 warmup_epochs=0, **HEAD)  # fmt: skip
    assert not hasattr(model.student, "patch_head")
    _fit(model, tmp_path, steps=1)
    with pytest.raises(ValueError, match="shared head has out_dim=64 prototypes, got ibot_out_dim=32"):
        DINO("xcit_nano_12_p8", ibot_loss_weight=1.0, ibot_separate_head=False, ibot_out_dim=32, **HEAD)


def test_weight_zero_keeps_dinos_layout_and_steps(tmp_path):
    """Weight 0 builds plain DINO: no mask token, patch head or patch loss, so checkpoints and the official
    step equivalence are untouched."""
    kwargs = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, warmup_epochs=0, **HEAD)
    off = DINO(ibot_loss_weight=0.0, **kwargs)
    assert not any("mask_token" in k or "patch_head" in k or "ibot" in k for k in off.state_dict())
    on = DINO(ibot_loss_weight=1.0, **kwargs)
    assert {
        "student.backbone.mask_token",
        "student.patch_head.last_layer.weight_v",
        "ibot_loss.center",
    } <= set(on.state_dict())


@pytest.mark.parametrize("weight", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])  # a fit each: budget
def test_the_patch_term_moves_the_patch_head_only_with_a_positive_weight(weight, tmp_path):
    """iBOT's machinery on (mask token, patch heads, masks drawn and the patch loss computed every step)
    with the term weighted 0: no gradient reaches the student's patch head, which AdamW then moves by its
    decoupled weight decay alone, bit for bit; weighted 1, the term moves it."""
    L.seed_everything(0)
    model = DINO(
        "xcit_nano_12_p8",
        backbone_kwargs={"depth": 1},
        ibot_loss_weight=1.0,
        warmup_epochs=0,
        lr=0.05,
        **HEAD,
    )
    model.hparams.ibot_loss_weight = weight  # machinery built, the term weighted `weight` in the total
    init = model.student.patch_head.mlp[0].weight.detach().clone()
    trainer = _fit(model, tmp_path)
    assert trainer.global_step == 2 and model.last_patch_collapse_signals is not None  # the patch loss ran
    decayed = init.clone()
    for step in range(2):  # AdamW with a zero gradient: p <- p * (1 - lr * wd), and nothing else
        lr, wd, _ = model.schedules.at(step)
        decayed.mul_(1 - lr * wd)
    assert torch.equal(model.student.patch_head.mlp[0].weight, decayed) == (weight == 0.0)


@pytest.mark.parametrize(  # CrossFormer++ takes ~9 s to build: -m slow
    "backbone", [pytest.param("crossformerpp_small", marks=pytest.mark.slow), "bixt_ti_l64_p16"]
)
def test_unmaskable_families_fail_at_construction(backbone):
    with pytest.raises(MaskingNotSupported, match="masking works with the xcit, vit, cait, dinov3 families"):
        DINO(backbone, ibot_loss_weight=1.0, **HEAD)
    DINO(backbone, ibot_loss_weight=0.0, **HEAD)  # plain DINO still builds


def test_masks_are_seeded_per_step_and_differ_between_steps():
    model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, ibot_loss_weight=1.0, **HEAD)
    crop = torch.zeros(8, 3, 64, 64)
    first = model.draw_masks(crop, [0, 0, 5, 0])
    assert first.masks.shape == (16, 64) and first.masks.dtype == torch.bool
    assert torch.equal(
        first.masks, model.draw_masks(crop, [0, 0, 5, 0]).masks
    )  # a resumed run draws the same
    assert not torch.equal(first.masks, model.draw_masks(crop, [0, 0, 5, 1]).masks)
    assert (first.masks.sum(1) > 0).sum() == 8  # half of the 16 global crops
    # The host's facts match the masks: positions in masks[masks] order, per-image weights.
    assert first.count == int(first.masks.sum())
    assert torch.equal(first.masks.flatten().nonzero().squeeze(1), first.image * 64 + first.patch)
    per_image = first.masks.sum(1).clamp(min=1).float()
    assert torch.equal(first.weights, (1.0 / per_image).unsqueeze(1).expand_as(first.masks)[first.masks])


def test_bad_ibot_settings_are_named():
    with pytest.raises(ValueError, match="ibot_loss_weight must be >= 0"):
        DINO("xcit_nano_12_p8", ibot_loss_weight=-1.0, **HEAD)
    with pytest.raises(ValueError, match=r"got \(0.5, 0.1\)"):
        DINO("xcit_nano_12_p8", ibot_loss_weight=1.0, mask_ratio_min_max=(0.5, 0.1), **HEAD)


class _Signals(L.LightningModule):
    """Just what the collapse guard reads: healthy DINO signals and a uniform patch teacher."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"out_dim": 64})
        self.ibot_out_dim = 128
        self.last_collapse_signals = (1.0, 0.5)
        self.last_patch_collapse_signals = (0.99 * torch.log(torch.tensor(128.0)).item(), 0.001)


def test_collapse_guard_watches_the_patch_term(monkeypatch):
    guard = CollapseGuard("stop", patience=3, grace_steps=0)
    module = _Signals()
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.__setitem__(name, value))

    class _Trainer:
        world_size, global_step, should_stop = 1, 5, False

    trainer = _Trainer()
    with pytest.warns(UserWarning, match=r"iBOT patch teacher collapse \(uniform\).*ln K = 4.852"):
        for _ in range(3):
            guard.on_train_batch_end(trainer, module)
    assert trainer.should_stop
    assert guard.events == [
        {"mode": "uniform", "step": 5, "entropy": pytest.approx(4.80, abs=0.01), "kl_to_uniform": pytest.approx(0.001),
         "term": "ibot"}
    ]  # fmt: skip
    assert logged["collapse/ibot_uniform"] == 1.0 and logged["collapse/uniform"] == 0.0


def test_compile_covers_the_masked_patch_pass(monkeypatch):
    """compile: true compiles the masked iBOT pass too (a plain method call that Module.compile() never sees):
    a counting backend gets a graph from `forward_with_patches`."""
    import torch._dynamo

    from ssl_xcit.dino import multicrop

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: real_compile(fn, backend=counting_backend))
    multicrop._compiled.cache_clear()
    torch._dynamo.reset()
    try:
        model = DINO(
            "xcit_nano_12_p8", backbone_kwargs={"depth": 1}, ibot_loss_weight=1.0, compile=True, **HEAD
        )
        model._trainer = SimpleNamespace(world_size=1)  # what configure_model reads of a Trainer
        model.configure_model()
        masks = model.draw_masks(torch.zeros(2, 3, 32, 32), [0, 0, 0, 0])
        before = len(graphs)
        model.student.forward_with_patches([torch.randn(2, 3, 32, 32)] * 2, masks.masks)
        assert len(graphs) > before
    finally:
        multicrop._compiled.cache_clear()
        torch._dynamo.reset()


def test_validation_loss_is_the_training_total_and_moves_nothing(tmp_path):
    """val/loss is compute_losses' total (DINO + KoLeo + iBOT), as train/loss; no centre or buffer moves."""
    L.seed_everything(0)
    model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, ibot_loss_weight=1.0, koleo_weight=0.5,
                 warmup_epochs=0, **HEAD)  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(model, DataLoader(Crops(), batch_size=8), verbose=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    crops = [torch.stack([Crops()[i][0][v] for i in range(8)]) for v in range(4)]
    model.eval()
    masks = model.draw_masks(crops[0], [torch.initial_seed() % 2**63, 0, 0, 0, 1])
    with torch.no_grad():
        out = model.compute_losses(crops, masks, epoch=0, update_center=False)
    metrics = trainer.callback_metrics
    assert float(metrics["val/loss"]) == pytest.approx(float(out.total), rel=1e-6)
    assert float(out.total) == pytest.approx(float(out.dino.loss + 0.5 * out.koleo + out.ibot.loss), rel=1e-6)
    assert float(metrics["val/koleo"]) > 0 and float(metrics["val/ibot_loss"]) > 0
