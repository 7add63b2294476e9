"""``ssl_xcit.trainer.memory_table``: the bilinear fit through four traces, its largest fitting batch, and the
extrapolated plan against a full-depth trace."""

from __future__ import annotations

import pytest

from ssl_xcit.trainer.memory_plan import GB, PlanInput, estimate
from ssl_xcit.trainer.memory_table import (
    BATCHES,
    DEPTHS,
    TERMS,
    Bilinear,
    DepthModel,
    depth_model,
    model_depth,
)


def test_bilinear_through_four_points_is_the_function():
    def f(b, d):
        return 3.5 + 2.0 * b + 7.0 * d + 0.25 * b * d

    fit = Bilinear.through({(b, d): f(b, d) for b in BATCHES for d in DEPTHS})
    assert (fit.c0, fit.cb, fit.cd, fit.cbd) == pytest.approx((3.5, 2.0, 7.0, 0.25))
    assert fit.at(100, 40) == pytest.approx(f(100, 40))


def test_max_batch_is_the_largest_batch_that_fits():
    zero = Bilinear(0, 0, 0, 0)
    terms = dict.fromkeys(TERMS, zero)
    # 1 GB per block and 10 MB per image and block in the backward; the update's peak is lower.
    terms["step_peak"] = Bilinear(1e9, 0, 1e9, 1e7)
    terms["update_peak"] = Bilinear(0, 0, 2e9, 0)
    model = DepthModel(terms, depth=24, plan=PlanInput({}))
    best = model.max_batch(80)
    assert model.at(best).fits(80) and not model.at(best + 1).fits(80)
    # one GPU: (80 GB - 1 GB) / 1.1 = 71.82 GB: (71.82e9 - 25e9) / 2.4e8 = 195.1 images
    assert best == 195 and model.at(best).peak <= 80 * GB
    # FSDP2 on 8 GPUs, two NCCL communicators: (80 GB - 5 GB) / 1.1 = 68.18 GB: 179.9 images
    sharded = DepthModel(terms, depth=24, plan=PlanInput({}, strategy="fsdp2", world_size=8))
    assert sharded.max_batch(80) == 179
    terms["update_peak"] = Bilinear(0, 0, 4e9, 0)  # 96 GB of states: nothing fits
    assert DepthModel(terms, depth=24, plan=PlanInput({})).max_batch(80) == 0


def test_model_depth_reads_the_variant_or_the_override():
    assert model_depth(PlanInput({"backbone": "vit_base_patch16_224"})) == 12
    assert model_depth(PlanInput({"backbone": "xcit_small_12_p16", "backbone_kwargs": {"depth": 3}})) == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_extrapolated_plan_is_close_to_the_full_depth_trace(strategy):
    args = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 8}, out_dim=256, head_hidden_dim=64,
                head_bottleneck_dim=32)  # fmt: skip
    plan = PlanInput(args, batch_size=24, global_crops_size=32, local_crops_number=2, local_crops_size=16,
                     precision="bf16-mixed", strategy=strategy, world_size=4)  # fmt: skip
    full, extrapolated = estimate(plan), depth_model(plan).at(24)
    for key in ("parameters", "gradients", "optimizer", "teachers"):
        assert getattr(extrapolated, key) == pytest.approx(getattr(full, key), rel=0.01), key
    assert extrapolated.traced_peak == pytest.approx(full.traced_peak, rel=0.06)
