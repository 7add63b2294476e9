"""DINOv2's segmentation protocol, piece by piece against hand-computed values and independent formulas: the
sliding windows, the training pipeline, the schedule, the loss over all pixels, ``reduce_zero_label``, and the
whole default protocol scored again by a numpy confusion matrix."""

from __future__ import annotations

import colorsys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssl_xcit.evaluation.segmentation import run_segment
from ssl_xcit.evaluation.segmentation.augment import TrainPipeline, _hue, _saturation, rescale_size
from ssl_xcit.evaluation.segmentation.data import reduce_zero_label
from ssl_xcit.evaluation.segmentation.probe import SegmentationProbe, poly_warmup_factors
from ssl_xcit.evaluation.segmentation.slide import center_pad, slide_logits, window_boxes

from .test_segment import halves, rescore, write_folder


def test_windows_as_mmsegmentation_places_them():
    # 7 wide, crop 4, stride 2: (7 - 4 + 1) // 2 + 1 = 3 windows; the third would end at 8, so it moves to 3..7.
    assert window_boxes(4, 7, 4, 2) == [(0, 4, 0, 4), (0, 4, 2, 6), (0, 4, 3, 7)]
    assert window_boxes(3, 5, 8, 5) == [(0, 3, 0, 5)]  # smaller than the crop: one window, the whole image
    # CamVid at DINOv2's test scale (480 x 360 -> 683 x 512): two windows across, overlapping by 341 px.
    assert rescale_size(360, 480, 512, 2048) == (512, 683)
    assert window_boxes(512, 683, 512, 341) == [(0, 512, 0, 512), (0, 512, 171, 683)]


def test_overlapping_windows_are_averaged_as_computed_by_hand():
    image = torch.arange(7.0).expand(3, 4, 7).clone()  # every channel holds the column index

    def window_logits(windows):  # one class: the pixel's column plus its window's left edge
        return windows[:, :1] + windows[:, :1, :1, :1]

    logits = slide_logits(window_logits, image, num_classes=1, crop=4, stride=2)
    # Windows start at columns 0, 2 and 3: column 2 is in two (2 + 0, 2 + 2), column 3 in three (3, 5, 6) ...
    expected = torch.tensor([0.0, 1.0, 3.0, 14 / 3, 6.5, 7.5, 9.0])
    torch.testing.assert_close(logits[0], expected.expand(4, 7))


def test_center_pad_splits_the_padding_evenly():
    padded = center_pad(torch.ones(1, 1, 5, 7), 4)
    assert padded.shape == (1, 1, 8, 8)
    assert padded[0, 0, :, 0].tolist() == [0, 1, 1, 1, 1, 1, 0, 0]  # 3 rows: 1 on top, 2 below
    assert padded[0, 0, 1].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]  # 1 column: on the right


def test_saturation_and_hue_equal_an_hsv_round_trip():
    rng = np.random.default_rng(0)
    pixels = rng.uniform(0, 255, (3, 1, 50)).astype(np.float32)
    pixels[:, 0, 0] = [40, 40, 40]  # grey: no saturation to scale
    for factor in (0.6, 1.4):
        ours = _saturation(torch.from_numpy(pixels), factor).numpy()
        for j in range(pixels.shape[-1]):
            h, s, v = colorsys.rgb_to_hsv(*(pixels[:, 0, j] / 255))
            expected = np.array(colorsys.hsv_to_rgb(h, min(s * factor, 1.0), v)) * 255
            np.testing.assert_allclose(ours[:, 0, j], expected, atol=1e-3)
    shifted = _hue(torch.from_numpy(pixels), 18).numpy()
    for j in range(pixels.shape[-1]):
        h, s, v = colorsys.rgb_to_hsv(*(pixels[:, 0, j] / 255))
        expected = np.array(colorsys.hsv_to_rgb((h + 0.1) % 1, s, v)) * 255
        np.testing.assert_allclose(shifted[:, 0, j], expected, atol=0.05)


def test_training_crops_are_scaled_cropped_and_padded():
    image = torch.rand(3, 30, 40) * 255
    mask = torch.zeros(30, 40, dtype=torch.long)
    mask[:, 20:] = 1
    steady = TrainPipeline(
        short_side=30, long_side=120, crop=16, ratio_range=(1, 1), flip_prob=0, photometric=False
    )
    crop, crop_mask = steady(image, mask, np.random.default_rng(0))
    assert crop.shape == (3, 16, 16) and crop_mask.shape == (16, 16)
    # No jitter, no colour: the crop is a window of the normalised image, and it holds both classes.
    mean, std = torch.tensor([0.485, 0.456, 0.406]) * 255, torch.tensor([0.229, 0.224, 0.225]) * 255
    pixels = crop * std.view(3, 1, 1) + mean.view(3, 1, 1)
    found = [
        (t, l)
        for t in range(15)
        for l in range(25)  # noqa: E741
        if torch.allclose(image[:, t : t + 16, l : l + 16], pixels, atol=1e-3)
    ]
    assert len(found) == 1 and set(crop_mask.unique().tolist()) == {0, 1}
    # Half the scale (ratio 0.5): 15 x 20 px, so the 16-px crop keeps all 15 rows and pads one with the ignore id.
    half = TrainPipeline(
        short_side=30, long_side=120, crop=16, ratio_range=(0.5, 0.5), flip_prob=0, photometric=False
    )
    small, small_mask = half(image, mask, np.random.default_rng(0))
    assert (small_mask[15] == 255).all() and (small[:, 15] == 0).all() and (small_mask[:15] != 255).all()


def test_poly_schedule_with_mmcv_warmup_by_hand():
    f = poly_warmup_factors(10, 4, warmup_ratio=1e-6)
    # Warmup multiplies the decayed lr: at 2 of 4 warmup steps, (1 - 2/10) * (1 - (1 - 2/4)(1 - 1e-6)).
    assert f[0] == pytest.approx(1e-6) and f[2] == pytest.approx(0.8 * (0.5 + 0.5e-6))
    assert f[4] == pytest.approx(0.6) and f[9] == pytest.approx(0.1) and len(f) == 10


def test_loss_averages_over_all_pixels_ignored_ones_adding_zero():
    torch.manual_seed(0)
    probe = SegmentationProbe(dim=3, num_classes=2, ignore_index=255)
    tokens = [torch.randn(4, 3), torch.randn(2, 3)]
    masks = [torch.tensor([[0, 1, 255, 1]] * 2), torch.tensor([[255, 0, 0, 1]])]
    probe.log = lambda *a, **k: None  # outside a Trainer
    loss = probe.training_step((tokens, [(2, 2), (1, 2)], masks, [0, 1]), 0)
    logits = probe.mask_logits(tokens, [(2, 2), (1, 2)], [m.shape for m in masks])
    nll = []
    for lg, m in zip(logits, masks, strict=True):
        logp = lg.detach().log_softmax(0).flatten(1)
        for p, label in enumerate(m.flatten().tolist()):
            if label != 255:
                nll.append(-logp[label, p].item())
    assert loss.item() == pytest.approx(sum(nll) / 12)  # 12 pixels, 3 of them ignored


def test_reduce_zero_label_as_mmsegmentation():
    mask = torch.tensor([[0, 1, 2], [150, 255, 3]])
    assert reduce_zero_label(mask, 255).tolist() == [[255, 0, 1], [149, 255, 2]]


def test_default_protocol_learns_and_its_predictions_rescore_the_same(tmp_path):
    from ssl_xcit.evaluation.segmentation.pixels import PixelPatches

    rng = np.random.default_rng(0)
    train = write_folder(tmp_path / "train", [halves(rng, (48, 96)) for _ in range(4)])
    val_pairs = [halves(rng, (48, 80)) for _ in range(2)]
    val = write_folder(tmp_path / "val", val_pairs)
    common = dict(model=PixelPatches(16), short_side=48, crop_size=32, stride=21, batch_size=4, lr=1e-2,
                  num_workers=0, accelerator="cpu", progress=False)  # fmt: skip
    preds = tmp_path / "preds"
    results = run_segment(train, val, iters=20, predictions=preds, **common)
    assert results["iters"] == 20 and results["fast"] is False and results["feature_cache_hit"] is None
    masks = {f"im{i}": mask.astype(np.int64) for i, (_, mask) in enumerate(val_pairs)}
    miou, acc = rescore(preds, masks, 2, 255)
    assert miou == pytest.approx(results["miou"]) and acc == pytest.approx(results["pixel_acc"])
    # Red against blue is linear in raw pixels: only pixels next to the cut can go wrong.
    assert results["miou"] > 85
    with pytest.raises(Exception, match="--epochs 3 counts passes of --fast"):
        run_segment(train, val, epochs=3, **common)


def test_crop_probe_logits_are_the_head_on_padded_tokens_resized_back():
    from ssl_xcit.evaluation.segmentation.pixels import PixelPatches
    from ssl_xcit.evaluation.segmentation.protocol import CropProbe

    torch.manual_seed(0)
    probe = CropProbe(PixelPatches(4), dim=48, num_classes=3, ignore_index=255).eval()
    images = torch.randn(2, 3, 6, 10)  # padded to 8 x 12: one row above and below, one column each side
    padded = F.pad(images, (1, 1, 1, 1))
    tokens = F.unfold(padded, 4, stride=4).transpose(1, 2)
    grid = probe.classifier(probe.bn(tokens.flatten(0, 1))).reshape(2, 2, 3, 3).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(6, 10), mode="bilinear", align_corners=False)
    torch.testing.assert_close(probe.logits(images), expected)
