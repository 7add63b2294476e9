"""DINOv3 and DINOv2-with-registers sources for ``--model.init_from`` and ``--model.teacher``: Meta's hub layout,
``timm:NAME@FILE`` and DINOv2's register models, each built here from random weights (no network), fill the
networks by value; DINO with iBOT and Gram runs on a DINOv3 ViT, DINO with Gram and distillation on a ConvNeXt."""

from __future__ import annotations

import lightning as L
import pytest
import timm
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.dino.distill import Distill
from ssl_xcit.dino.init_from import apply_weights, check_timm_architecture, read_source
from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model

HEAD = dict(out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16)
CONVNEXT = {"depths": (1, 1, 1, 1), "dims": (8, 8, 16, 16)}
TINY = dict(embed_dim=32, depth=2, num_heads=2)


def _meta_vit(state: dict, periods: torch.Tensor, mask_token: torch.Tensor) -> dict:
    """timm's names of a DINOv3 ViT with q/v biases and a plain MLP -> Meta's hub layout (tests/models/
    test_dinov3.py checks the general form against timm's converter)."""
    out = {"mask_token": mask_token, "rope_embed.periods": periods}
    for key, value in state.items():
        if key.endswith("attn.qkv.weight"):
            base = key[: -len("qkv.weight")]
            q, v = state[base + "q_bias"], state[base + "v_bias"]
            out[base + "qkv.bias"] = torch.cat([q, torch.randn_like(q), v])
            out[base + "qkv.bias_mask"] = torch.cat(
                [torch.ones_like(q), torch.zeros_like(q), torch.ones_like(q)]
            )
        if not key.endswith(("q_bias", "v_bias")):
            key = key.replace("reg_token", "storage_tokens").replace(".gamma_1", ".ls1.gamma")
            out[key.replace(".gamma_2", ".ls2.gamma")] = value
    return out


def _same(module: torch.nn.Module, want: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    for key, value in module.state_dict().items():
        if key not in skip:
            torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def _meta_file(path, name: str = "vit_small_patch16_dinov3_qkvb", **kwargs) -> tuple[dict, torch.Tensor]:
    """A Meta-layout hub file of a random ``name`` (timm's values kept aside to compare with)."""
    torch.manual_seed(3)
    source = create_model(name, **kwargs)
    with torch.no_grad():
        for key, value in source.state_dict().items():
            if key.endswith(("q_bias", "v_bias")):
                value.normal_()
    mask_token = torch.randn(1, source.embed_dim)
    state = {k: v.clone() for k, v in source.state_dict().items()}
    torch.save(_meta_vit(state, source.rope.periods.to(torch.bfloat16), mask_token), path)
    return state, mask_token


def test_init_from_a_meta_dinov3_file_fills_student_teacher_and_ibots_mask_token(tmp_path):
    state, mask_token = _meta_file(tmp_path / "dinov3_vits16_pretrain.pth", **TINY)
    dino = DINO("vit_small_patch16_dinov3_qkvb", backbone_kwargs=TINY, ibot_loss_weight=1.0, **HEAD)
    loaded = apply_weights(dino, read_source(str(tmp_path / "dinov3_vits16_pretrain.pth")))
    assert loaded["head"] is False and loaded["patch_head"] is False  # fresh heads: the warm-up applies
    for side in (dino.student, dino.teacher):
        _same(side.backbone, state, skip=("mask_token",))
        torch.testing.assert_close(side.backbone.mask_token, mask_token, rtol=0, atol=0)  # Meta's own


def test_init_from_a_timm_name_with_a_local_file(tmp_path):
    name = "vit_tiny_patch16_dinov3_qkvb"
    torch.manual_seed(4)
    released = timm.create_model(name, num_classes=0)
    save_file(released.state_dict(), tmp_path / "model.safetensors")
    source = f"timm:{name}.eupe_lvd1689m@{tmp_path / 'model.safetensors'}"
    check_timm_architecture(source, name)
    with pytest.raises(UserError, match=f"holds a {name} backbone, but --model.backbone is vit_small"):
        check_timm_architecture(source, "vit_small_patch16_dinov3")
    dino = DINO(name, **HEAD)
    apply_weights(dino, read_source(source))
    for side in (dino.student, dino.teacher):
        _same(side.backbone, released.state_dict())


def test_init_from_meta_dinov2_with_registers(tmp_path):
    kwargs = dict(depth=1, img_size=28, embed_dim=32, num_heads=2)
    torch.manual_seed(5)
    shapes = create_model("vit_small_patch14_reg4_dinov2", **kwargs).state_dict()
    meta = {k: torch.randn_like(v) for k, v in shapes.items() if k not in ("reg_token", "pos_embed")}
    meta |= {
        "register_tokens": torch.randn(1, 4, 32),
        "pos_embed": torch.randn(1, 5, 32),
        "mask_token": torch.zeros(1, 32),
    }
    torch.save(meta, tmp_path / "dinov2_vits14_reg4_pretrain.pth")
    dino = DINO("vit_small_patch14_reg4_dinov2", backbone_kwargs=kwargs, **HEAD)
    apply_weights(dino, read_source(str(tmp_path / "dinov2_vits14_reg4_pretrain.pth")))
    want = {
        k: v for k, v in meta.items() if k not in ("register_tokens", "pos_embed", "cls_token", "mask_token")
    }
    want |= {"reg_token": meta["register_tokens"], "pos_embed": meta["pos_embed"][:, 1:]}
    want["cls_token"] = meta["cls_token"] + meta["pos_embed"][:, :1]  # Meta's CLS position row, folded in
    _same(dino.teacher.backbone, want)


class Crops(Dataset):
    """2 global and 2 local crops (sides ``size`` and ``size // 2``) per item; with ``gram``, the Gram teacher's
    crops too (the global crops themselves, as the datamodule gives a model anchoring at scale 1)."""

    def __init__(self, size: int, gram: bool = False) -> None:
        self.size, self.gram = size, gram

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(i)
        sides = (self.size, self.size, self.size // 2, self.size // 2)
        crops = [torch.randn(3, s, s, generator=gen) for s in sides]
        return ({"crops": crops, "gram_crops": crops[:2]} if self.gram else crops), 0, i


def _fit(model, size: int, tmp_path, steps: int = 2) -> L.Trainer:
    trainer = L.Trainer(max_epochs=1, limit_train_batches=steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, DataLoader(Crops(size, gram=model.hparams.gram_loss_weight > 0), batch_size=4))
    return trainer


def test_dino_with_ibot_and_gram_trains_a_dinov3_vit(tmp_path):
    L.seed_everything(0)
    model = DINO("vit_small_patch16_dinov3", backbone_kwargs=TINY, ibot_loss_weight=1.0, gram_loss_weight=1.0,
                 warmup_epochs=0, freeze_last_layer=0, lr=0.05, **HEAD)  # fmt: skip
    token = model.student.backbone.mask_token.detach().clone()
    trainer = _fit(model, 32, tmp_path)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert "train/gram_loss" in trainer.callback_metrics
    assert not torch.equal(model.student.backbone.mask_token, token)  # iBOT's masked term reached it


def test_dino_with_gram_trains_a_convnext_and_ibot_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="convolution mixes each patch") as info:
        DINO("convnext_tiny", backbone_kwargs=CONVNEXT, ibot_loss_weight=1.0, **HEAD)
    assert "\n" not in str(info.value)
    L.seed_everything(0)
    model = DINO("convnext_tiny", backbone_kwargs=CONVNEXT, gram_loss_weight=1.0, warmup_epochs=0,
                 freeze_last_layer=0, lr=0.05, **HEAD)  # fmt: skip
    before = model.student.backbone.stem[0].weight.detach().clone()
    trainer = _fit(model, 64, tmp_path)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/gram_loss"])
    assert not torch.equal(model.student.backbone.stem[0].weight, before)


def test_meta_dinov3_file_as_distillation_teacher_of_a_convnext_student(tmp_path):
    """The hub file names no architecture: its widths, biases and depth say vit_small_patch16_dinov3_qkvb with
    one block; the ConvNeXt student regresses its CLS and patch tokens (grid resized to the student's)."""
    state, _ = _meta_file(tmp_path / "meta.pth", depth=1)
    model = Distill(teacher=str(tmp_path / "meta.pth"), teacher_resolution=64, backbone="convnext_tiny",
                    backbone_kwargs=CONVNEXT, head_hidden_dim=32, head_bottleneck_dim=16, warmup_epochs=0,
                    freeze_last_layer=0)  # fmt: skip
    assert model.teacher.backbone.name == "vit_small_patch16_dinov3_qkvb" and model.teacher.cls_dim == 384
    _same(model.teacher.backbone, state)
    trainer = _fit(model, 64, tmp_path)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    _same(model.teacher.backbone, state)


@pytest.mark.slow  # a full ConvNeXt-T from timm: 6 s on 2 cores
def test_timm_convnext_teacher_gives_dinov3s_tokens_to_a_dinov3_student(tmp_path):
    torch.manual_seed(6)
    released = timm.create_model("convnext_tiny", num_classes=0)
    save_file(released.state_dict(), tmp_path / "convnext.safetensors")
    model = Distill(teacher=f"timm:convnext_tiny.dinov3_lvd1689m@{tmp_path / 'convnext.safetensors'}",
                    teacher_resolution=64, backbone="vit_small_patch16_dinov3", backbone_kwargs=TINY,
                    head_hidden_dim=32, head_bottleneck_dim=16, warmup_epochs=0, freeze_last_layer=0)  # fmt: skip
    assert type(model.teacher.backbone).__name__ == "TimmConvNeXt" and model.teacher.patch_dim == 768
    _same(model.teacher.backbone, released.state_dict())
    trainer = _fit(model, 32, tmp_path)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
