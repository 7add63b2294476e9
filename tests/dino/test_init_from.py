"""``init_from``: each kind of SOURCE, built in the test in its own layout, fills a tiny DINO exactly; heads and
centres come along where SOURCE has them; bad sources end in one line; the head-only warm-up holds the backbone;
a resumed run keeps its checkpoint's weights and never reads SOURCE again."""

from __future__ import annotations

import argparse

import lightning as L
import pytest
import torch

from ssl_xcit.dino.init_from import AUTO_HEAD_WARMUP_STEPS, apply_weights, read_source
from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError
from ssl_xcit.models.export import save_safetensors

SMALL_HEAD = dict(out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16)
TINY = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, **SMALL_HEAD)


def _dino(seed: int, **overrides) -> DINO:
    torch.manual_seed(seed)
    return DINO(**{**TINY, **overrides})


def _trained_looking(seed: int, **overrides) -> DINO:
    """A DINO whose student and teacher differ everywhere (as after training) and whose centres are not 0."""
    model = _dino(seed, **overrides)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("center"))]:
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g))
    return model


def _official_xcit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (timm's) XCiT names -> the official code's: ``pos_embeder.*`` and a fused class-attention qkv."""
    out = {}
    for key, value in state.items():
        if key.startswith("pos_embed."):
            out["pos_embeder." + key[len("pos_embed.") :]] = value
        elif ".attn.q." in key:
            fused = [state[key.replace(".attn.q.", f".attn.{p}.")] for p in "qkv"]
            out[key.replace(".attn.q.", ".attn.qkv.")] = torch.cat(fused)
        elif ".attn.k." not in key and ".attn.v." not in key:
            out[key] = value
    return out


def _assert_same(got: torch.nn.Module, want: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    for key, value in got.state_dict().items():
        if key not in skip:
            torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_our_checkpoint_continues_with_both_heads_and_centres(tmp_path):
    source = _trained_looking(0, ibot_loss_weight=1.0)
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, path)
    model = _dino(1, ibot_loss_weight=1.0)
    loaded = apply_weights(model, read_source(str(path)))
    assert loaded == {"head": True, "patch_head": True, "centres": True}
    _assert_same(model, source.state_dict())  # student, teacher, heads, patch heads, both centres


def test_official_full_checkpoint_continues_with_its_head_and_centre(tmp_path):
    run = _trained_looking(2)  # the official run: student (DDP) and teacher in the official XCiT names
    official = {}
    for side, prefix in (("student", "module."), ("teacher", "module.")):  # XCiT's teacher is DDP-wrapped too
        network = getattr(run, side)
        state = {f"backbone.{k}": v for k, v in _official_xcit(network.backbone.state_dict()).items()}
        state |= {f"head.{k}": v for k, v in network.head.state_dict().items()}
        official[side] = {prefix + k: v for k, v in state.items()}
    official |= {
        "optimizer": {"state": {}, "param_groups": []},
        "epoch": 300,
        "args": argparse.Namespace(arch="xcit_nano_12_p8", out_dim=64),
        "dino_loss": {"center": run.dino_loss.center.clone()},
    }
    path = tmp_path / "dino_xcit_nano_12_p8_pretrain_full_checkpoint.pth"
    torch.save(official, path)

    model = _dino(3)
    loaded = apply_weights(model, read_source(str(path)))
    assert loaded == {"head": True, "patch_head": False, "centres": True}
    _assert_same(model, run.state_dict())
    assert not torch.equal(model.student.backbone.cls_token, model.teacher.backbone.cls_token)  # each its own


def _official_pretrain(model: DINO, path):
    torch.save(_official_xcit(model.teacher.backbone.state_dict()), path)


def _export_safetensors(model: DINO, path):
    save_safetensors(model.teacher.backbone.state_dict(), "xcit_nano_12_p8", {"depth": 1}, path)


def _export_pth(model: DINO, path):
    hyper = {"backbone": "xcit_nano_12_p8", "backbone_kwargs": {"depth": 1}}
    torch.save({"state_dict": model.teacher.backbone.state_dict(), "hyper_parameters": hyper}, path)


@pytest.mark.parametrize(
    "write, name",
    [
        (_official_pretrain, "dino_xcit_nano_12_p8_pretrain.pth"),
        (_export_safetensors, "teacher.safetensors"),
        (_export_pth, "teacher.pth"),
    ],
    ids=["official-pretrain", "export-safetensors", "export-pth"],
)
def test_a_backbone_file_starts_both_backbones_with_fresh_equal_heads(write, name, tmp_path):
    source = _trained_looking(4)
    write(source, tmp_path / name)
    model = _dino(5, ibot_loss_weight=1.0)  # iBOT: its mask tokens are training-only and stay fresh
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    loaded = apply_weights(model, read_source(str(tmp_path / name)))
    assert loaded == {"head": False, "patch_head": False, "centres": False}
    for side in ("student", "teacher"):
        _assert_same(
            getattr(model, side).backbone, source.teacher.backbone.state_dict(), skip=("mask_token",)
        )
    for key, value in model.state_dict().items():
        if ".backbone." not in key or key.endswith("mask_token"):  # heads, patch heads, centres untouched
            torch.testing.assert_close(value, fresh[key], rtol=0, atol=0, msg=key)
    _assert_same(model.teacher.head, model.student.head.state_dict())


def test_timm_weights_from_a_local_file(tmp_path):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(6)
    released = timm.create_model("xcit_nano_12_p16_224", num_classes=1000)  # as timm's hub stores it
    save_file(released.state_dict(), tmp_path / "model.safetensors")
    model = _dino(7, backbone="xcit_nano_12_p16", backbone_kwargs={})
    weights = read_source(f"timm:xcit_nano_12_p16_224.fb_in1k@{tmp_path / 'model.safetensors'}")
    assert apply_weights(model, weights)["head"] is False
    want = released.state_dict()
    for side in ("student", "teacher"):
        _assert_same(getattr(model, side).backbone, want)  # every tensor but timm's classifier


@pytest.mark.parametrize(
    "source, expected",
    [
        ("{tmp}/missing.ckpt", "file not found"),
        ("timm:xcit_nano_12_p16_2244", "timm has no model 'xcit_nano_12_p16_2244' (did you mean"),
        (
            "timm:xcit_nano_12_p16_224.bogus",
            "its weights for xcit_nano_12_p16_224: xcit_nano_12_p16_224.fb_dist",
        ),
        ("timm:xcit_nano_12_p16_224.fb_in1k@{tmp}/missing.safetensors", "weights file not found"),
        ("timm:vit_base_patch16_gap_224", "timm has no pretrained weights for vit_base_patch16_gap_224"),
    ],
    ids=[
        "missing-file",
        "unknown-timm-name",
        "unknown-timm-tag",
        "missing-timm-file",
        "timm-without-weights",
    ],
)
def test_bad_sources_are_one_line(source, expected, tmp_path):
    with pytest.raises(UserError) as error:
        read_source(source.format(tmp=tmp_path))
    assert expected in _one_line(error)


def test_keys_that_do_not_fit_are_refused_by_name(tmp_path):
    path = tmp_path / "teacher.safetensors"
    _export_safetensors(_trained_looking(8), path)
    deeper = _dino(9, backbone_kwargs={"depth": 2})
    before = {k: v.clone() for k, v in deeper.state_dict().items()}
    with pytest.raises(UserError) as error:
        apply_weights(deeper, read_source(str(path)))
    message = _one_line(error)
    assert "does not fit the student backbone xcit_nano_12_p8 with depth=2: missing [blocks.1." in message
    assert "it holds xcit_nano_12_p8 with depth=1" in message
    _assert_same(deeper, before)  # nothing was loaded

    full = tmp_path / "last.ckpt"
    torch.save({"state_dict": _trained_looking(10).state_dict()}, full)
    with pytest.raises(UserError) as error:
        apply_weights(_dino(11, out_dim=32), read_source(str(full)))
    assert (
        "its student head does not fit the model's (shapes (source vs model) [last_layer.weight_g (64, 1) vs "
        in (_one_line(error))
    )
    with pytest.raises(
        UserError, match="holds a xcit_nano_12_p16 backbone, but --model.backbone is xcit_nano_12_p8"
    ):
        from ssl_xcit.dino.init_from import check_timm_architecture

        check_timm_architecture("timm:xcit_nano_12_p16_224.fb_in1k", "xcit_nano_12_p8")


class _Snapshots(L.Callback):
    """The student's backbone parameters (BatchNorm statistics move in any train-mode forward) and head at the
    start of training and after every step."""

    def __init__(self) -> None:
        self.backbones, self.heads = [], []

    def _take(self, module) -> None:
        self.backbones.append({k: v.clone() for k, v in module.student.backbone.named_parameters()})
        self.heads.append({k: v.clone() for k, v in module.student.head.state_dict().items()})

    def on_train_start(self, trainer, pl_module):
        self._take(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._take(pl_module)


def _changed(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # ~13 s: a fit and its resume; test_auto_warmup_* check the warm-up's length by default
def test_fresh_head_trains_alone_first_and_a_resume_never_reads_the_source_again(tmp_path, tiny):
    path = tmp_path / "teacher.safetensors"
    source = _trained_looking(12)
    _export_safetensors(source, path)
    snaps = _Snapshots()
    model = tiny.model(init_from=str(path), init_head_warmup_steps=2, warmup_epochs=0)
    trainer = tiny.trainer(tmp_path, max_epochs=1, callbacks=[snaps], limit_train_batches=3)
    trainer.fit(model, tiny.loader(n=12))
    assert model.init_state == {"source": str(path), "head_warmup_steps": 2}
    want = source.teacher.backbone.state_dict()
    assert [_changed(b, want) for b in snaps.backbones] == [False, False, False, True]  # steps 1-2: head only
    assert all(_changed(a, b) for a, b in zip(snaps.heads, snaps.heads[1:], strict=False))

    # Resume with SOURCE gone: the checkpoint's weights and warm-up are kept, SOURCE is not read.
    path.unlink()
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["init_from"] == {"source": str(path), "head_warmup_steps": 2}
    resumed = tiny.model(init_from=str(path), init_head_warmup_steps=2, warmup_epochs=0)
    again = _Snapshots()
    trainer = tiny.trainer(tmp_path, max_epochs=2, callbacks=[again], limit_train_batches=3)
    trainer.fit(resumed, tiny.loader(n=12), ckpt_path=str(ckpt))
    prefix = "student.backbone."
    start = {k[len(prefix) :]: v for k, v in saved["state_dict"].items() if k.startswith(prefix)}
    assert not _changed(again.backbones[0], start) and _changed(start, source.teacher.backbone.state_dict())
    assert resumed.init_state == saved["init_from"]


def test_auto_warmup_only_without_a_head(tmp_path, tiny):
    backbone, full = tmp_path / "teacher.safetensors", tmp_path / "last.ckpt"
    source = _trained_looking(13)
    _export_safetensors(source, backbone)
    torch.save({"state_dict": source.state_dict()}, full)
    for path, steps in ((backbone, AUTO_HEAD_WARMUP_STEPS), (full, 0)):
        model = tiny.model(init_from=str(path))
        trainer = tiny.trainer(tmp_path / path.suffix[1:], max_epochs=1, limit_train_batches=1)
        trainer.fit(model, tiny.loader(n=4))
        assert model.init_state["head_warmup_steps"] == steps


@pytest.mark.slow  # ~5 s: a fit (the suite's time budget); test_auto_warmup_only_without_a_head runs by default
def test_auto_warmup_covers_every_fresh_head(tmp_path, tiny):
    """A source with a DINO head but no iBOT patch head (as an official checkpoint of an iBOT-less run): the
    random patch head must warm up alone too, the backbone held, instead of training into it from step 1. With
    both heads in SOURCE there is nothing to warm up; with a shared head (no patch head) neither."""
    dino_only, both = tmp_path / "dino_only.ckpt", tmp_path / "both.ckpt"
    torch.save({"state_dict": _trained_looking(14).state_dict()}, dino_only)
    torch.save({"state_dict": _trained_looking(15, ibot_loss_weight=1.0).state_dict()}, both)
    cases = (
        (dino_only, {"ibot_loss_weight": 1.0}, AUTO_HEAD_WARMUP_STEPS),
        (dino_only, {"ibot_loss_weight": 1.0, "ibot_separate_head": False}, 0),
        (both, {"ibot_loss_weight": 1.0}, 0),
    )
    for i, (path, options, steps) in enumerate(cases):
        model = tiny.model(init_from=str(path), **options)
        trainer = tiny.trainer(tmp_path / str(i), max_epochs=1, limit_train_batches=1)
        trainer.fit(model, tiny.loader(n=4))
        assert model.init_state["head_warmup_steps"] == steps, (path.name, options)
        if steps:  # the backbone's weights did not move (BN statistics do): the step trained the heads alone
            source = torch.load(path, weights_only=True)["state_dict"]
            for key, value in model.student.backbone.named_parameters():
                if key != "mask_token":
                    assert torch.equal(value, source[f"student.backbone.{key}"]), key
