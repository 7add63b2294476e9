"""benchmarks/bench_lightly.py: both DINO implementations train on one tiny setting with identical settings."""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightly")

from ssl_xcit.data.datamodule import DINODataModule  # noqa: E402
from ssl_xcit.data.datasets import ImageDataset  # noqa: E402
from ssl_xcit.data.synthetic import ensure_synthetic_dataset  # noqa: E402
from ssl_xcit.dino.module import DINO  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lightly.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_lightly", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = ensure_synthetic_dataset(
        tmp_path_factory.mktemp("syn") / "data", image_size=32, num_train_per_class=4, num_val_per_class=2
    )
    dm = DINODataModule(
        root=str(root / "train"),
        val_root=str(root / "val"),
        batch_size=8,
        num_workers=0,
        persistent_workers=False,
        global_crops_size=32,
        local_crops_number=2,
        local_crops_size=16,
        color_jitter=(0.6, 0.5, 0.3, 0.15),  # not lightly's default, so a dropped setting would show
        eval_resize=32,
        eval_crop=32,
    )
    dm.setup("fit")
    model_kw = dict(
        backbone="xcit_nano_12_p16",
        backbone_kwargs={"depth": 1},
        out_dim=64,
        head_hidden_dim=48,
        head_bottleneck_dim=16,
        use_bn_in_head=True,
        warmup_teacher_temp=0.02,
        warmup_teacher_temp_epochs=2,
        momentum_teacher=0.9,
        lr=0.01,
        warmup_epochs=0,
        freeze_last_layer=0,
        collapse_guard="off",
    )
    torch.manual_seed(0)
    return dm, model_kw


def _max_change(before: torch.nn.Module, after: torch.nn.Module) -> float:
    pairs = zip(before.parameters(), after.parameters(), strict=True)
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def test_identical_settings_and_start_weights(bench, tiny):
    dm, model_kw = tiny
    model = DINO(**model_kw)
    hp = bench.ours_hparams(model, dm, epochs=1, steps_per_epoch=2)
    student, teacher, loss_fn = bench.build_lightly(hp, model.student)
    read_back = bench.lightly_hparams(student, loss_fn, bench.lightly_transform(hp), hp)
    assert read_back == hp
    assert hp["color_jitter"] == (0.6, 0.5, 0.3, 0.15) and hp["warmup_teacher_temp"] == 0.02
    # Same start: lightly's student and teacher give our student's outputs (eval mode: no drop path; our
    # pre-BN biases start at zero, so BN's running statistics see the same values).
    x = torch.randn(6, 3, 32, 32)
    for net in (model.student, student, teacher):
        net.eval()
    with torch.no_grad():
        ours = model.student.head(model.student.backbone(x))
        torch.testing.assert_close(student(x), ours, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(teacher(x), ours, atol=1e-5, rtol=1e-4)


def test_lightly_limits_are_errors(bench, tiny):
    dm, model_kw = tiny
    hp = bench.ours_hparams(DINO(**{**model_kw, "head_nlayers": 2}), dm, 1, 2)
    with pytest.raises(ValueError, match="head_nlayers=2"):
        bench.check_lightly_can(hp)
    hp = {**hp, "head_nlayers": 3, "local_solarize_prob": 0.2}
    with pytest.raises(ValueError, match="local_solarize_prob=0.2"):
        bench.check_lightly_can(hp)


def test_both_sides_train_two_steps(bench, tiny):
    dm, model_kw = tiny
    model = DINO(**model_kw)
    init = copy.deepcopy(model.student)
    hp = bench.ours_hparams(model, dm, epochs=1, steps_per_epoch=2)

    ours = bench.train_ours(model, dm, epochs=1, limit_batches=2)
    assert ours["steps"] == 2 and len(ours["losses"]) == 2
    assert all(math.isfinite(v) for v in ours["losses"])
    assert _max_change(init.backbone, model.student.backbone) > 1e-4
    assert _max_change(init.backbone, model.teacher.backbone) > 1e-6  # EMA moved the teacher

    student, teacher, loss_fn = bench.build_lightly(hp, init)
    teacher_start = copy.deepcopy(teacher.backbone)
    dataset = ImageDataset(dm.train_dataset.samples, dm.train_dataset.classes, bench.lightly_transform(hp))
    out = bench.train_lightly(hp, student, teacher, loss_fn, dataset, workers=0, seed=0)
    assert out["steps"] == 2 and len(out["losses"]) == 2
    assert all(math.isfinite(v) for v in out["losses"])
    assert _max_change(init.backbone, student.backbone) > 1e-4
    assert _max_change(teacher_start, teacher.backbone) > 1e-6
    assert float(loss_fn.center.abs().sum()) > 0  # lightly's centre was updated
    assert len(out["signals"]) == 2 and all(math.isfinite(e) and math.isfinite(k) for e, k in out["signals"])
    assert len(ours["signals"]) == 2

    # Both evaluate through the same k-NN path on the held-out images.
    for backbone in (model.teacher.backbone, teacher.backbone):
        top1 = bench.knn_top1(backbone, dm)
        assert 0.0 <= top1 <= 100.0


def test_lightly_collapse_signals_on_constructed_cases(bench):
    from lightly.loss import DINOLoss

    loss_fn = DINOLoss(
        output_dim=8, warmup_teacher_temp=0.02, teacher_temp=0.04, warmup_teacher_temp_epochs=2
    )
    uniform = [torch.zeros(4, 8), torch.zeros(4, 8)]
    entropy, kl = bench._signals(loss_fn, uniform, epoch=0)
    assert entropy == pytest.approx(math.log(8), abs=1e-6) and kl == pytest.approx(0.0, abs=1e-6)
    one_hot = [torch.eye(8)[:4] * 10, torch.eye(8)[:4] * 10]  # four prototypes, one per image, very sharp
    entropy, kl = bench._signals(loss_fn, one_hot, epoch=5)
    assert entropy == pytest.approx(0.0, abs=1e-6) and kl == pytest.approx(
        math.log(8) - math.log(4), abs=1e-5
    )
