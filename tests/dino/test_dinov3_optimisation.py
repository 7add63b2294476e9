"""DINOv3's optimisation details (issue 53): per-submodule clipping, the local crops' DINO weight, layer-wise lr
decay with the patch embedding's multiplier, the sqrt lr scaling rule, a constant teacher momentum and teachers
in eval mode. Each expected value is a formula or config value of facebookresearch/dinov3 (commit 6876159), with
its file named; the computations here are written independently of ours."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from ssl_xcit.dino.distill import Distill
from ssl_xcit.dino.loss import DINOLoss
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.optim import (
    apply_schedules,
    clip_gradients,
    clip_per_module,
    get_params_groups,
    objective_optimisation,
)
from ssl_xcit.dino.optimizer_step import before_optimizer_step
from ssl_xcit.dino.schedules import cosine_schedule, dino_schedules, local_weight_ramp, scaled_lr
from ssl_xcit.errors import UserError

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "continue_dinov3.yaml"
TINY_HEAD = dict(out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8, drop_path_rate=0.0)


def _student_with_grads() -> nn.Module:
    """Backbone, DINO head and iBOT head with fixed gradients: norms 13 (5, 12), 0.5 and 40 (per submodule)."""
    student = nn.Module()
    student.backbone = nn.Linear(2, 1, bias=True)
    student.head = nn.Linear(1, 1, bias=False)
    student.patch_head = nn.Linear(2, 2, bias=False)
    student.backbone.weight.grad = torch.tensor([[3.0, 4.0]])
    student.backbone.bias.grad = torch.tensor([12.0])
    student.head.weight.grad = torch.tensor([[0.5]])
    student.patch_head.weight.grad = torch.tensor([[0.0, 24.0], [32.0, 0.0]])
    return student


# ------------------------------------------------------------------------------------------------- clipping
def test_per_module_clip_is_clip_grad_norm_of_each_submodule():
    """dinov3/train/train.py: ``for k, v in student.items(): clip_grad_norm_(v.parameters(), max_norm=clip_grad)``:
    each submodule's gradients scaled together by min(1, clip / (total norm + 1e-6))."""
    ours, reference = _student_with_grads(), _student_with_grads()
    for child in reference.children():
        torch.nn.utils.clip_grad_norm_(child.parameters(), max_norm=3.0)
    norms = clip_per_module(ours, 3.0)
    assert {k: float(v) for k, v in norms.items()} == pytest.approx(
        {"backbone": 13.0, "head": 0.5, "patch_head": 40.0}
    )
    for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7, msg=name)
    # The backbone's 12 becomes 12 * 3 / 13: a per-parameter clip would have left the weight's 5 at 3 and 12 at 3.
    assert float(ours.backbone.bias.grad) == pytest.approx(12 * 3 / (13 + 1e-6))
    per_parameter = _student_with_grads()
    clip_gradients(per_parameter, 3.0)
    assert float(per_parameter.backbone.bias.grad) == pytest.approx(3.0, rel=1e-5)


def test_the_step_clips_as_clip_mode_says():
    """The module's hook (before the optimiser step) runs the chosen clip on the student."""
    for mode, expected in (("per_module", 12 * 3 / (13 + 1e-6)), ("per_parameter", 3 * 12 / (12 + 1e-6))):
        model = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1}, clip_mode=mode, freeze_last_layer=0,
                     **TINY_HEAD)  # fmt: skip
        model.student = _student_with_grads()
        before_optimizer_step(model, None)
        assert float(model.student.backbone.bias.grad) == pytest.approx(expected)


def test_a_bad_clip_mode_is_named():
    with pytest.raises(UserError, match="clip_mode must be one of per_parameter, per_module, got 'global'"):
        DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1}, clip_mode="global", **TINY_HEAD)


# ----------------------------------------------------------------------------------------- local crops' weight
def _dinov3_dino_loss(student_logits, teacher_probs, student_temp):
    """dinov3/loss/dino_clstoken_loss.py ``forward``: the mean over (sample, student crop, teacher crop) of the
    cross-entropy, pairs of the same crop left out when the student's crops are the teacher's (the global term)."""
    s, _, _ = student_logits.shape
    logp = torch.log_softmax(student_logits / student_temp, dim=-1)
    ce = -torch.einsum("sbk,tbk->stb", logp, teacher_probs)  # (s, t, b)
    if s == teacher_probs.shape[0]:  # global crops: ignore_diagonal
        keep = ~torch.eye(s, dtype=torch.bool)
        return ce[keep].mean()
    return ce.mean()


@pytest.mark.parametrize("weight", [1.0, 0.5, 0.0])
def test_local_weight_scales_the_local_pairs_as_dinov3(weight):
    """dinov3/train/ssl_meta_arch.py ``compute_losses``: global_scale x global loss + local_scale x weight x local
    loss, with global terms G(G - 1), local terms G L, and each scale a term count over their sum."""
    torch.manual_seed(0)
    g, n_local, b, k, temp, s_temp = 2, 3, 4, 8, 0.04, 0.1
    teacher = torch.randn(g * b, k)
    student = torch.randn((g + n_local) * b, k)
    loss = DINOLoss(k, warmup_teacher_temp=temp, teacher_temp=temp, student_temp=s_temp)
    ours = loss(student, teacher, epoch=0, update_center=False, local_weight=weight).loss
    probs = torch.softmax(teacher / temp, dim=-1).view(g, b, k)  # centre 0: DINO's targets at the start
    views = student.view(g + n_local, b, k)
    global_terms, local_terms = g * (g - 1), g * n_local
    global_scale = global_terms / (global_terms + local_terms)
    local_scale = local_terms / (global_terms + local_terms)
    expected = global_scale * _dinov3_dino_loss(
        views[:g], probs, s_temp
    ) + local_scale * weight * _dinov3_dino_loss(views[g:], probs, s_temp)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


def _dinov3_schedule(start, peak, end, warmup_iterations, total_iterations, cosine_iterations):
    """dinov3/train/cosine_lr_scheduler.py ``linear_warmup_cosine_decay``: linear start -> peak (endpoint
    excluded), a half cosine peak -> end over cosine_iterations (both ends included), then end."""
    out = [start + (peak - start) * i / warmup_iterations for i in range(warmup_iterations)]
    for i in range(cosine_iterations):
        angle = math.pi * i / (cosine_iterations - 1) if cosine_iterations > 1 else 0.0
        out.append(end + (peak - end) * (1 + math.cos(angle)) / 2)
    return np.array(out + [end] * (total_iterations - warmup_iterations - cosine_iterations))


def test_local_weight_eases_on_the_gram_ramp_as_dinov3_7b():
    """dinov3/configs/train/dinov3_vit7b16_gram_anchor.yaml ``dino.local_loss_weight_schedule``: start 1, peak 1,
    end 0.5, warmup_epochs 1000 (the Gram start), cosine_epochs 1 (the Gram ramp), here at 10 / 7 of 30 steps."""
    expected = _dinov3_schedule(1.0, 1.0, 0.5, 10, 30, 7)
    np.testing.assert_allclose(local_weight_ramp(0.5, 10, 7, 30), expected, rtol=0, atol=1e-12)
    # dinov3_vit7b16_high_res_adapt.yaml: 0.5 throughout (no ramp).
    np.testing.assert_array_equal(local_weight_ramp(0.5, 0, 0, 5)[:5], np.full(5, 0.5))
    assert local_weight_ramp(1.0, 10, 7, 30) is None
    hp = dict(_HP, local_crops_weight=0.5, gram_start_step=10, gram_weight_warmup_steps=7)
    s = dino_schedules(hp, epochs=3, batches=10, per_device_batch=4, world_size=1)
    assert [s.local_weight_at(i) for i in (0, 9, 16, 29, 500)] == pytest.approx([1, 1, 0.5, 0.5, 0.5])


def test_the_step_weights_the_local_pairs():
    """The module's loss with the local weight 0 is the global pairs' sum over all pairs' count: 2 of 2 + 2 x 2."""
    torch.manual_seed(0)
    model = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1, "patch_size": 8}, **TINY_HEAD)
    model._set_training_modes()
    crops = [
        torch.randn(2, 3, 16, 16),
        torch.randn(2, 3, 16, 16),
        torch.randn(2, 3, 8, 8),
        torch.randn(2, 3, 8, 8),
    ]
    with torch.no_grad():
        global_only = model.compute_losses(crops[:2], None, 0, update_center=False).total
        model.local_weight_now = 0.0
        weighted = model.compute_losses(crops, None, 0, update_center=False).total
    torch.testing.assert_close(weighted, global_only * 2 / 6, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------- lr groups
_HP = dict(
    lr=1e-3, min_lr=1e-6, warmup_epochs=0, weight_decay=0.04, weight_decay_end=0.04, momentum_teacher=0.994,
    scale_lr_with_batch=True, accumulate_grad_batches=1,
)  # fmt: skip


def _scales(model: nn.Module, groups: list[dict]) -> dict[str, tuple[float, bool]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr_scale"], g["regularized"]) for g in groups for p in g["params"]}


def test_layerwise_decay_and_patch_embed_multiplier_of_a_tiny_vit():
    """dinov3/train/param_groups.py ``get_vit_lr_decay_rate``: rate ** (depth + 1 - layer id), layer 0 for
    patch_embed, pos_embed, cls/storage/mask tokens, block i -> i + 1, the rest depth + 1; the heads (no blocks)
    1; ``patch_embed`` x patch_embed_lr_mult. Constructed: depth 3, rate 0.9, multiplier 0.2."""
    model = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 3}, layerwise_decay=0.9, patch_embed_lr_mult=0.2,
                 **TINY_HEAD)  # fmt: skip
    groups = get_params_groups(model.student, 0.9, 0.2)
    scales = _scales(model.student, groups)
    expected = {
        "backbone.cls_token": 0.9**4,
        "backbone.pos_embed": 0.9**4,
        "backbone.patch_embed.proj.weight": 0.9**4 * 0.2,
        "backbone.patch_embed.proj.bias": 0.9**4 * 0.2,
        "backbone.blocks.0.attn.qkv.weight": 0.9**3,
        "backbone.blocks.1.mlp.fc1.bias": 0.9**2,
        "backbone.blocks.2.norm1.weight": 0.9,
        "backbone.norm.weight": 1.0,
        "head.mlp.0.weight": 1.0,
        "head.last_layer.weight_v": 1.0,
    }
    for name, scale in expected.items():
        assert scales[name][0] == pytest.approx(scale, rel=1e-12), name
    # Weight-decay exclusions as before: biases and 1-D tensors.
    assert not scales["backbone.patch_embed.proj.bias"][1] and not scales["backbone.norm.weight"][1]
    assert scales["backbone.blocks.0.attn.qkv.weight"][1] and scales["backbone.cls_token"][1]
    assert len(scales) == sum(p.requires_grad for p in model.student.parameters())
    # Every group's lr is the schedule's times its multiplier; weight decay on the regularised ones only.
    opt = torch.optim.AdamW(groups, lr=0.0)
    apply_schedules(opt, 0.01, 0.05)
    for group in opt.param_groups:
        assert group["lr"] == pytest.approx(0.01 * group["lr_scale"])
        assert group["weight_decay"] == (0.05 if group["regularized"] else 0.0)
    # The module's own optimiser is built from these groups.
    assert len(model.configure_optimizers().param_groups) == len(groups)


def test_layer_ids_of_xcit_put_class_attention_after_the_blocks():
    """XCiT (here: depth 2): its Fourier position encoding and convolutional stem are layer 0, its class-attention
    blocks come after the last block (depth + 1), as the final norm."""
    model = DINO("xcit_nano_12_p16", backbone_kwargs={"depth": 2}, **TINY_HEAD)
    scales = _scales(model.student, get_params_groups(model.student, 0.5, 1.0))
    assert scales["backbone.pos_embed.token_projection.weight"][0] == 0.5**3
    assert scales["backbone.patch_embed.proj.0.0.weight"][0] == 0.5**3
    assert scales["backbone.blocks.1.attn.qkv.weight"][0] == 0.5
    assert scales["backbone.cls_attn_blocks.0.attn.q.weight"][0] == 1.0


def test_default_groups_are_dinos_two():
    model = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1}, **TINY_HEAD)
    groups = get_params_groups(model.student)
    assert len(groups) == 2 and "lr_scale" not in groups[0] and groups[1]["weight_decay"] == 0.0


def test_layerwise_decay_needs_blocks():
    model = DINO(
        "convnext_tiny", backbone_kwargs={"depths": (1, 1, 1, 1), "dims": (8, 16, 32, 64)}, **TINY_HEAD
    )
    with pytest.raises(UserError, match="layerwise_decay=0.99 needs a backbone with a stack of blocks"):
        get_params_groups(model.student, 0.99, 1.0)
    with pytest.raises(UserError, match=r"layerwise_decay must be in \(0, 1\]"):
        DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1}, layerwise_decay=1.5, **TINY_HEAD)


# --------------------------------------------------------------------------------------- scaling, momentum
def test_sqrt_scaling_rule_is_dinov3s():
    """dinov3/train/train.py ``build_schedulers_v2``: ``sqrt_wrt_1024`` multiplies by 4 sqrt(batch / 1024);
    ``linear_wrt_256`` by batch / 256."""
    for batch in (64, 256, 1024, 4096):
        assert scaled_lr(1e-3, batch, "sqrt_wrt_1024") == pytest.approx(1e-3 * 4 * math.sqrt(batch / 1024))
        assert scaled_lr(1e-3, batch, "linear_wrt_256") == pytest.approx(1e-3 * batch / 256)
    s = dino_schedules(dict(_HP, lr_scaling_rule="sqrt_wrt_1024"), 1, 4, per_device_batch=32, world_size=2)
    assert s.peak_lr == pytest.approx(1e-3 * 4 * math.sqrt(64 / 1024))
    # DINOv3 scales the schedule's end too (lr_end), DINO's linear rule the peak only: lr = min_lr gives a constant
    # lr of min_lr x the factor under the sqrt rule, and a cosine from the scaled peak to min_lr under the linear.
    flat = dict(_HP, lr=1e-6, min_lr=1e-6)
    sqrt_run = dino_schedules(dict(flat, lr_scaling_rule="sqrt_wrt_1024"), 1, 4, 32, 2).lr
    np.testing.assert_allclose(sqrt_run, np.full(4, 1e-6 * 4 * math.sqrt(64 / 1024)), rtol=1e-12)
    linear_run = dino_schedules(flat, 1, 4, 32, 2).lr
    np.testing.assert_allclose(linear_run, cosine_schedule(1e-6 * 64 / 256, 1e-6, 1, 4), rtol=1e-12)
    with pytest.raises(UserError, match="lr_scaling_rule must be one of linear_wrt_256, sqrt_wrt_1024"):
        scaled_lr(1e-3, 64, "sqrt")


def test_constant_teacher_momentum():
    """dinov3/configs/train/dinov3_vit7b16_{gram_anchor,high_res_adapt}.yaml ``schedules.momentum``: 0.999 from
    start to end; the distilled ViT-L's (dinov3_vitl16_lvd1689m_distilled.yaml) rises 0.994 -> 1 on a cosine."""
    s = dino_schedules(dict(_HP, momentum_teacher=0.999, final_momentum_teacher=0.999), 2, 5, 4, 1)
    np.testing.assert_array_equal(s.momentum, np.full(10, 0.999))
    rising = dino_schedules(_HP, 2, 5, 4, 1).momentum  # CosineScheduler (cosine_lr_scheduler.py): i / 10
    np.testing.assert_allclose(
        rising, [1 - 0.003 * (1 + math.cos(math.pi * i / 10)) for i in range(10)], atol=1e-15
    )


# --------------------------------------------------------------------------------------------- teacher mode
def test_teachers_run_in_eval_mode_under_rope_rescaling():
    """dinov3/train/ssl_meta_arch.py ``SSLMetaArch.train``: the teacher and the Gram teacher in eval mode while
    the student trains. With RoPE's train-time coordinate rescaling on, two teacher forwards of one input agree;
    two student forwards differ (drop path is off: RoPE's rescaling is the only draw)."""
    torch.manual_seed(0)
    model = DINO("vit_small_patch16_dinov3", backbone_kwargs={"depth": 1, "rope_rescale_coords": 2},
                 teacher_mode="eval", gram_loss_weight=1.0, **TINY_HEAD)  # fmt: skip
    model.eval()  # Lightning's validation; training puts the modes back
    model._set_training_modes()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.teacher.backbone(x), model.teacher.backbone(x), rtol=0, atol=0)
        gram = model.gram_teacher.backbone
        torch.testing.assert_close(gram(x), gram(x), rtol=0, atol=0)
        assert not torch.equal(model.student.backbone(x), model.student.backbone(x))
    assert model.student.training and not model.teacher.training and not gram.training
    model.eval()
    assert not gram.training  # validation sees the same Gram term
    default = DINO(
        "vit_small_patch16_dinov3", backbone_kwargs={"depth": 1, "rope_rescale_coords": 2}, **TINY_HEAD
    )
    default._set_training_modes()  # DINO's reference: the teacher in train mode
    assert default.teacher.training


# ----------------------------------------------------------------------------------------- DINOv3's values
def test_the_dinov3_objective_defaults_are_dinov3s_distillation_config():
    """dinov3/configs/train/dinov3_vitl16_lvd1689m_distilled.yaml ``optim``: clip_grad 3.0 (clipped per submodule
    by train.py), layerwise_decay 0.99, patch_embed_lr_mult 0.2, scaling_rule sqrt_wrt_1024."""
    given = dict(clip_mode=None, layerwise_decay=None, patch_embed_lr_mult=None, lr_scaling_rule=None)
    assert objective_optimisation(True, "vit_small_patch16_dinov3", **given) == dict(
        clip_mode="per_module", layerwise_decay=0.99, patch_embed_lr_mult=0.2, lr_scaling_rule="sqrt_wrt_1024"
    )
    assert objective_optimisation(True, "convnext_tiny", **given)["layerwise_decay"] == 1.0
    assert objective_optimisation(False, "vit_small_patch16_dinov3", **given) == dict(
        clip_mode="per_parameter",
        layerwise_decay=1.0,
        patch_embed_lr_mult=1.0,
        lr_scaling_rule="linear_wrt_256",
    )
    assert (
        objective_optimisation(True, "vit_small_patch16_dinov3", **{**given, "layerwise_decay": 0.9})[
            "layerwise_decay"
        ]
        == 0.9
    )


def test_the_dinov3_objective_sets_them(tmp_path):
    source = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, **TINY_HEAD)  # a teacher read in a second
    path = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, path)
    kwargs = dict(backbone="vit_tiny_patch16_224", backbone_kwargs={"depth": 2, "patch_size": 8}, **TINY_HEAD)
    model = Distill(teacher=str(path), objective="dinov3", **kwargs)
    hp = model.hparams
    assert (hp.clip_mode, hp.layerwise_decay, hp.patch_embed_lr_mult, hp.lr_scaling_rule) == (
        "per_module",
        0.99,
        0.2,
        "sqrt_wrt_1024",
    )
    groups = model.configure_optimizers().param_groups
    assert min(g["lr_scale"] for g in groups) == pytest.approx(0.99**3 * 0.2)
    features = Distill(teacher=str(path), objective="features", **kwargs).hparams
    assert (features.clip_mode, features.layerwise_decay) == ("per_parameter", 1.0)


def test_the_continue_dinov3_recipe_sets_dinov3s_values():
    """recipes/continue_dinov3.yaml against DINOv3's configs: clip per submodule (train.py), patch embedding
    x 0.2 and sqrt_wrt_1024 (every config), layer-wise decay 0.99 (the distilled ViTs' config; the 7B's 0.98),
    the local crops at 0.5 (dinov3_vit7b16_high_res_adapt.yaml), a constant momentum and teachers in eval mode
    (ssl_meta_arch.py)."""
    args = yaml.safe_load(RECIPE.read_text())["model"]["init_args"]
    assert args["clip_mode"] == "per_module" and args["clip_grad"] == 3.0
    assert args["layerwise_decay"] == 0.99 and args["patch_embed_lr_mult"] == 0.2
    assert args["lr_scaling_rule"] == "sqrt_wrt_1024"
    assert args["local_crops_weight"] == 0.5
    assert args["final_momentum_teacher"] == args["momentum_teacher"]
    assert args["teacher_mode"] == "eval"
    # The peak the linear rule gave the measured lr (1e-4 per 256) at the recipe's batch of 64 is kept.
    batch = yaml.safe_load(RECIPE.read_text())["data"]["init_args"]["batch_size"]
    assert scaled_lr(args["lr"], batch, "sqrt_wrt_1024") == pytest.approx(1e-4 * 64 / 256)


# ------------------------------------------------------------------------------------------------------ FSDP2
@pytest.mark.slow  # ~40 s on 2 cores, most of it two processes importing torch
@pytest.mark.distributed
def test_per_module_clip_takes_the_global_norm_under_fsdp2(tmp_path):
    """Two gloo processes, the student's submodules sharded by FSDP2: each rank's clip uses the whole gradients'
    norm (the local shards' squared norms summed over the mesh), so the gathered clipped gradients equal
    ``clip_grad_norm_`` of the unsharded submodules (dinov3/train/train.py), on both ranks."""
    from conftest import torchrun

    torchrun(Path(__file__).with_name("clip_fsdp2_worker.py"), str(tmp_path), timeout=120)
    for rank in range(2):
        run = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert run["norms"] == pytest.approx(run["expected"], rel=1e-6)
        assert all(
            run["local"][k] < 0.9 * run["expected"][k] for k in run["expected"]
        )  # a shard's norm differs
        assert run["clipped"].keys() == run["reference"].keys()
        for name, grad in run["reference"].items():
            torch.testing.assert_close(run["clipped"][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_dinov3_objective_resolves_them_under_the_command_line(tmp_path):
    """LightningCLI hands the module its config as the hyperparameters (None for the objective's reference):
    the module keeps the values the objective resolved, which a checkpoint then carries."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

    source = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, **TINY_HEAD)
    path = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, path)
    given = dict(teacher=str(path), objective="dinov3", backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1},
                 clip_mode=None, layerwise_decay=None, patch_embed_lr_mult=None, lr_scaling_rule=None, **TINY_HEAD)  # fmt: skip
    config = {  # every option, as the command line's config holds them
        name: p.default
        for cls in (DINO, Distill)
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind is p.POSITIONAL_OR_KEYWORD
    }
    config.update(given)
    cli = "lightning.pytorch.cli.instantiate_module"
    with _given_hyperparameters_context(hparams=config, instantiator=cli):
        hp = Distill(**given).hparams
    assert (hp.clip_mode, hp.layerwise_decay, hp.patch_embed_lr_mult, hp.lr_scaling_rule) == (
        "per_module",
        0.99,
        0.2,
        "sqrt_wrt_1024",
    )
