"""DINO's training step on fake CUDA tensors: no device mismatch and no host sync inside a step.

``FakeTensorMode`` runs the real operators by shape on fake ``cuda`` tensors (no GPU needed): a CPU tensor
meeting a CUDA one raises ``FakeTensorDeviceMismatchError``, reading a value on the host (``.item()``,
``bool(t)``) raises ``DataDependentOutputException``, and a data-dependent shape (``t[mask]``) raises
``DynamicOutputShapeException``. :class:`NoBlockingCopies` adds the last kind of sync: a copy between host and
device that the host waits for (device to host, or host to device without ``non_blocking``). Each case runs
one full step's work with the module's own methods: mask drawing, the forwards, DINO/KoLeo/iBOT losses and
Sinkhorn-Knopp (``compute_losses``), the finite-loss record, clipping and the last-layer freeze
(``on_before_optimizer_step``), the optimiser step, the EMA update, the logged host numbers and the collapse
guard's buffering. Backward itself needs a CUDA runtime even on fake tensors (autograd's engine asks for\nthe device's primary context), so gradients of the right shapes stand in for it. bfloat16 casts module and inputs, as ``bf16-true`` does (autocast is off without a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import timm.layers
import timm.models.vision_transformer
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ssl_xcit.dino.collapse import CollapseGuard
from ssl_xcit.dino.module import DINO
from ssl_xcit.utils.transfer import scalars_to_device

COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


class NoBlockingCopies(TorchDispatchMode):
    """Raise on a host<->device copy the host would wait for."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COPIES:
            if func is torch.ops.aten._to_copy.default:
                src, dst = args[0].device, kwargs.get("device") or args[0].device
                non_blocking = kwargs.get("non_blocking", False)
            else:
                src, dst = args[1].device, args[0].device
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if src.type == "cuda" and dst.type == "cpu":
                raise AssertionError(f"device-to-host copy (a sync): {func}")
            if src.type == "cpu" and dst.type == "cuda" and not non_blocking:
                raise AssertionError(f"blocking host-to-device copy (a sync): {func}")
        return func(*args, **kwargs)


class _Trainer:  # what the collapse guard reads of a trainer
    world_size, global_step = 1, 500


def one_step(
    backbone: str,
    dtype: torch.dtype,
    centering: str,
    ibot: bool,
    koleo: bool,
    ibot_bn_stats: str = "all",
    gram_scale: int = 0,
    options: dict | None = None,
) -> torch.Tensor:
    default = torch.get_default_dtype()
    # Parameters made in `dtype`, as bf16-true's init context does (a fake module cannot be cast afterwards).
    torch.set_default_dtype(dtype)
    try:
        return _one_step(backbone, dtype, centering, ibot, koleo, ibot_bn_stats, gram_scale, options or {})
    finally:
        torch.set_default_dtype(default)


def _one_step(
    backbone: str,
    dtype: torch.dtype,
    centering: str,
    ibot: bool,
    koleo: bool,
    ibot_bn_stats: str,
    gram_scale: int,
    options: dict,
) -> torch.Tensor:
    with FakeTensorMode(), torch.device("cuda"):
        model = DINO(
            backbone,
            backbone_kwargs={"depth": 1},
            out_dim=64,
            head_hidden_dim=32,
            head_bottleneck_dim=16,
            centering=centering,
            ibot_loss_weight=1.0 if ibot else 0.0,
            ibot_bn_stats=ibot_bn_stats,
            koleo_weight=0.1 if koleo else 0.0,
            freeze_last_layer=1,
            gram_loss_weight=1.0 if gram_scale else 0.0,  # gram_scale 0: Gram anchoring off
            gram_resolution_scale=max(gram_scale, 1),
            **options,
        )
        assert next(model.parameters()).dtype == dtype
        crops = [torch.randn(4, 3, s, s, dtype=dtype) for s in (32, 32, 16, 16)]
        # The Gram teacher's own crops, as the loader cuts them (gram_scale x the global side).
        gram_crops = (
            [torch.randn(4, 3, 32 * gram_scale, 32 * gram_scale, dtype=dtype)] * 2 if gram_scale else None
        )
        guard = CollapseGuard("warn", patience=5, grace_steps=0)
        guard.read_every = 50
        watch = NoBlockingCopies()  # the step, not the construction
        watch.__enter__()
        masks = model.draw_masks(crops[0], [0, 0, 0, 0]) if ibot else None
        model._update_gram_teacher(0)  # Gram anchoring's snapshot of the EMA teacher at its start step
        out = model.compute_losses(crops, masks, epoch=0, update_center=True, gram_crops=gram_crops)
        model._finite.observe(out.total, step=0)
        assert out.total.requires_grad and out.total.grad_fn is not None
        # autograd's engine asks the CUDA runtime for a primary context of the tensors' device
        # ("hasPrimaryContext expects a valid device index"): backward cannot run without a GPU, fake or
        # not. Gradients of the parameters' shapes, devices and dtypes stand in for it; the backward kernels
        # are autograd's own, with no code of ours between them.
        for p in model.student.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        for targets in model._teacher_targets():  # the window's centre move (once per optimiser step)
            targets.apply_center()
        optimizer = model.configure_optimizers()
        model.on_before_optimizer_step(optimizer)  # clipping, last-layer freeze
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model._update_teacher(0.996)
        # What training_step logs from the host, and what the collapse guard keeps between its reads.
        scalars = scalars_to_device({"train/lr": 1e-3, "train/skipped_batches": 0}, torch.device("cuda"))
        model.signal_tensors["dino"] = (out.dino.teacher_entropy, out.dino.kl_to_uniform)
        if out.ibot is not None:
            model.signal_tensors["ibot"] = (out.ibot.teacher_entropy, out.ibot.kl_to_uniform)
        guard.on_train_batch_end(_Trainer(), model)
        watch.__exit__(None, None, None)
    assert out.total.device.type == "cuda" and scalars["train/lr"].device.type == "cuda"
    assert (out.koleo is not None) == koleo and (out.ibot is not None) == ibot
    assert (out.gram is not None) == bool(gram_scale)
    assert len(guard._pending) == 1  # buffered on the device, not read
    return out.total


CASES = [
    # (backbone, dtype, centering, ibot, koleo)
    ("xcit_nano_12_p8", torch.float32, "ema", True, True),
    ("xcit_nano_12_p8", torch.bfloat16, "sinkhorn_knopp", True, True),
    ("xcit_nano_12_p8", torch.float32, "sinkhorn_knopp", False, False),
    ("xcit_nano_12_p8", torch.bfloat16, "ema", False, True),
    ("vit_tiny_patch16_224", torch.float32, "sinkhorn_knopp", True, True),
    ("vit_tiny_patch16_224", torch.bfloat16, "ema", True, False),
    ("cait_xxs24", torch.float32, "ema", True, True),
    ("cait_xxs24", torch.bfloat16, "sinkhorn_knopp", True, True),
]


@pytest.mark.parametrize(
    "backbone, dtype, centering, ibot, koleo",
    CASES,
    ids=[f"{b.split('_')[0]}-{str(d)[6:]}-{c}-ibot{int(i)}-koleo{int(k)}" for b, d, c, i, k in CASES],
)
def test_training_step_has_no_device_mismatch_and_no_host_sync(
    backbone, dtype, centering, ibot, koleo, monkeypatch
):
    # Construction only: torch 2.14's nn.init.trunc_normal_ (the heads' init) redraws out-of-range values in
    # a loop on `mask.any()`, a host read fake tensors cannot answer. timm's erfinv sampler draws the same
    # distribution in one pass; the step itself is untouched.
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", timm.layers.trunc_normal_)
    # timm's ViT reads its per-block drop-path rates with `.item()` of a linspace: the same numbers from numpy.
    monkeypatch.setattr(
        timm.models.vision_transformer,
        "calculate_drop_path_rates",
        lambda rate, depth: np.linspace(0, rate, depth).tolist(),
    )
    total = one_step(backbone, dtype, centering, ibot, koleo)
    assert total.shape == () and total.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_unmasked_batchnorm_statistics_stay_on_the_device(dtype, monkeypatch):
    """``ibot_bn_stats: unmasked`` (XCiT's stem and LPI BatchNorms from the unmasked crops): the crops' weights
    and counts stay device tensors, so the masked pass still has no host sync."""
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", timm.layers.trunc_normal_)
    total = one_step("xcit_nano_12_p8", dtype, "ema", True, False, ibot_bn_stats="unmasked")
    assert total.shape == () and total.dtype == torch.float32


GRAM_CASES = [
    # (backbone, dtype, ibot, gram_scale); the last two are slow (fake mode runs every op's Python dispatch)
    pytest.param("xcit_nano_12_p8", torch.float32, True, 2, id="xcit-float32-ibot1-x2"),
    pytest.param("vit_tiny_patch16_224", torch.bfloat16, True, 2, id="vit-bfloat16-ibot1-x2"),
    pytest.param(
        "xcit_nano_12_p8", torch.bfloat16, False, 1, id="xcit-bfloat16-ibot0-x1", marks=pytest.mark.slow
    ),
    pytest.param("cait_xxs24", torch.float32, False, 2, id="cait-float32-ibot0-x2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("backbone, dtype, ibot, gram_scale", GRAM_CASES)
def test_gram_anchoring_step_has_no_device_mismatch_and_no_host_sync(
    backbone, dtype, ibot, gram_scale, monkeypatch
):
    """Gram anchoring on (``ssl_xcit.dino.gram``): the snapshot of the EMA teacher, the Gram teacher's forward
    at 1x or 2x, the bicubic resize and the Gram loss stay on the device, in float32 and bfloat16. Chunks of
    one image: the checkpointed path that bounds the term's memory at large token counts."""
    import ssl_xcit.dino.gram

    monkeypatch.setattr(ssl_xcit.dino.gram, "CHUNK_BYTES", 1)
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", timm.layers.trunc_normal_)
    monkeypatch.setattr(
        timm.models.vision_transformer,
        "calculate_drop_path_rates",
        lambda rate, depth: np.linspace(0, rate, depth).tolist(),
    )
    total = one_step(backbone, dtype, "sinkhorn_knopp", ibot, True, gram_scale=gram_scale)
    assert total.shape == () and total.dtype == torch.float32


# DINOv3's step options at their non-default values (recipes/continue_dinov3.yaml's), with Gram anchoring, which
# the local crops' weight schedule follows: the clip per submodule, layer-wise and patch-embedding lr multipliers,
# a constant teacher momentum, local crops at half weight, eval-mode teachers, a plain last layer.
DINOV3_OPTIONS = dict(clip_mode="per_module", layerwise_decay=0.9, patch_embed_lr_mult=0.2,
                      final_momentum_teacher=0.996, local_crops_weight=0.5, teacher_mode="eval",
                      head_last_layer="linear")  # fmt: skip


@pytest.mark.parametrize(  # the other two pairs with -m slow (the suite's time budget)
    "backbone, dtype",
    [
        ("xcit_nano_12_p8", torch.float32),
        ("vit_tiny_patch16_224", torch.bfloat16),
        pytest.param("xcit_nano_12_p8", torch.bfloat16, marks=pytest.mark.slow),
        pytest.param("vit_tiny_patch16_224", torch.float32, marks=pytest.mark.slow),
    ],
    ids=["xcit-float32", "vit-bfloat16", "xcit-bfloat16", "vit-float32"],
)
def test_dinov3_options_step_has_no_device_mismatch_and_no_host_sync(backbone, dtype, monkeypatch):
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", timm.layers.trunc_normal_)  # as the test above
    monkeypatch.setattr(
        timm.models.vision_transformer,
        "calculate_drop_path_rates",
        lambda rate, depth: np.linspace(0, rate, depth).tolist(),
    )
    total = one_step(backbone, dtype, "sinkhorn_knopp", True, True, gram_scale=1, options=DINOV3_OPTIONS)
    assert total.shape == () and total.dtype == torch.float32


def test_the_watch_catches_each_kind_of_sync():
    """The bar can fail: each kind of host sync the step avoids raises inside the fake mode."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    with FakeTensorMode(), torch.device("cuda"), NoBlockingCopies():
        masks = torch.rand(4, 9) > 0.5
        with pytest.raises(DataDependentOutputException):
            int(masks.sum())
        with pytest.raises(DynamicOutputShapeException):
            torch.randn(4, 9, 8)[masks]
        with pytest.raises(AssertionError, match="blocking host-to-device"):
            torch.tensor([1.0], device="cuda")
        with pytest.raises(AssertionError, match="device-to-host"):
            masks.cpu()
