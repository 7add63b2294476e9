"""The loop census (``loop_census.py``): real ``ssl-xcit fit`` steps of the quickstart recipe, as a user runs
them (its progress bar, loggers, the online k-NN monitor at the epoch's end, checkpoints), with accumulation 2.
Over whole iterations of Lightning's epoch loop (one batch's fetch to the next, hooks included), no host read
outside the iterations that read on purpose: every ``sync_every_n_steps`` (= ``log_every_n_steps`` here)
micro-batches, and the epoch's end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import torchrun
from loop_census import ALLOWANCE, check_steady, steady_windows
from PIL import Image

WORKER = Path(__file__).with_name("census_worker.py")
WARMUP = 2  # the first iterations: optimiser state, the first schedules and groups are made there
STEPS = 8  # micro-batches per rank: 4 optimiser steps, 2 sync windows of 4


# Sites whose fix belongs to another branch of issue 35 (regular expressions on the site); remove an entry once
# that branch is merged.
def images(root: Path, per_class: int) -> Path:
    """2 labelled classes of small JPEGs (train) and 3 each (val), ImageFolder layout."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", 3)):
        for c in range(2):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8) // 2 + 60 * c
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.jpg")
    return root


def check(windows: list[dict], label: str, precision: str = "32-true") -> None:
    assert len(windows) == STEPS, [(w["epoch"], w["batch_idx"]) for w in windows]
    steady = steady_windows(windows, WARMUP)
    marked = [w for w in windows if "sync" in w["marks"]]
    assert len(steady) >= STEPS // 2 and len(marked) == STEPS // 4, [w["marks"] for w in windows]
    check_steady(windows, ALLOWANCE[precision], WARMUP, label=f"{label}, {precision}")
    # augment_on=device as on a GPU: every batch cut and augmented in its transfer (the census's count).
    assert all(w["device_augment"] >= 1 for w in windows), [w["device_augment"] for w in windows]


@pytest.mark.parametrize(
    "precision", ["32-true", "16-mixed", pytest.param("bf16-mixed", marks=pytest.mark.slow)]
)
def test_quickstart_loop_reads_nothing_between_syncs(tmp_path, precision):
    """One process, in this one (~10 s): the progress bar, logging, accumulation, the k-NN monitor. 16-mixed
    with the CPU GradScaler and the toolkit's default there (fused AdamW): no ``found_inf.item()`` per step."""
    import census_worker

    data = images(tmp_path / "images", per_class=16)
    windows = census_worker.main(tmp_path / precision, data, 1, STEPS, precision)
    check(windows, "1 process", precision)


# DINOv3's step options at their non-default values (the continue recipe's): each adds work to the step, none a host
# read (a clip per submodule, layer-wise and patch-embedding lr multipliers, the sqrt lr rule, a constant teacher
# momentum, local crops at half weight, an eval-mode teacher, a plain last layer).
DINOV3_OPTIONS = (
    "--model.init_args.clip_mode=per_module", "--model.init_args.layerwise_decay=0.9",
    "--model.init_args.patch_embed_lr_mult=0.2", "--model.init_args.lr_scaling_rule=sqrt_wrt_1024",
    "--model.init_args.final_momentum_teacher=0.996", "--model.init_args.local_crops_weight=0.5",
    "--model.init_args.teacher_mode=eval", "--model.init_args.head_last_layer=linear",
)  # fmt: skip


@pytest.mark.slow  # ~10 s (the suite's time budget)
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_dinov3_options_read_nothing_between_syncs(tmp_path, precision):
    import census_worker

    data = images(tmp_path / "images", per_class=16)
    windows = census_worker.main(tmp_path / precision, data, 1, STEPS, precision, DINOV3_OPTIONS)
    check(windows, "1 process, DINOv3's options", precision)


def test_census_counts_a_tensor_made_on_a_device_named_by_a_string():
    """``torch.tensor(data, device="cuda")`` is a blocking host-to-device copy as with ``torch.device("cuda")``;
    a ``"cpu"`` string is not. (Made on the meta device: the census sees the call, no CUDA is needed.)"""
    from loop_census import LoopCensus, _Function

    census = LoopCensus()
    census._window = {"epoch": 0, "batch_idx": 0, "global_step": 0, "marks": [], "found": []}
    with _Function(census):
        for device in ("meta", torch.device("meta"), "cpu"):
            torch.tensor([1.0], device=device)
    assert [kind for kind, _ in census._window["found"]] == ["copy", "copy"]


# What CUDA's sync debug mode reports, each case once, and the host's own work (tensors made without a device,
# copies to the host, what operators make of them) not at all. `device` is a tensor the census did not see made:
# the device's, as is every tensor `.to(device)` gives (on this CPU the same tensor).
SYNC_CASES = {
    "item": (lambda device: device.sum().item(), ["read"]),
    "bool": (lambda device: bool(device.sum() > 0), ["read"]),
    "cpu then tolist": (lambda device: device.cpu().tolist(), ["read"]),
    "to cpu by name": (lambda device: device.to("cpu").numpy(), ["read"]),
    "to cpu, non-blocking": (lambda device: device.to("cpu", non_blocking=True), []),
    "tolist": (lambda device: device.tolist(), ["read"]),
    "nonzero": (lambda device: device.nonzero(), ["shape"]),
    "boolean mask": (lambda device: device[device > 0], ["shape"]),
    "repeat_interleave of a tensor": (lambda device: device.repeat_interleave(device.long()), ["shape"]),
    "repeat_interleave of an int": (lambda device: device.repeat_interleave(3, dim=0), []),
    "host tensor to device": (lambda device: torch.zeros(3).to(device.device), ["copy"]),
    "host tensor to device, non-blocking": (
        lambda device: torch.ones(3).to(device.device, non_blocking=True).sum().item(),
        ["read"],  # the copy is queued; reading its result back waits
    ),
    "copy into a device tensor": (lambda device: device.copy_(torch.ones(4)), ["copy"]),
    "host indices": (lambda device: device[torch.tensor([0, 1])], ["copy"]),
    "device indices": (lambda device: device[device.long().clamp(0, 3)], []),
    "tensor on a device": (lambda device: torch.tensor([1.0], device=device.device), ["copy"]),
    "new_tensor": (lambda device: device.new_tensor([1.0, 2.0]), ["copy"]),
    "full on a device": (lambda device: torch.full((2,), 3.0, device=device.device), []),
    "host work": (lambda device: torch.arange(4).float().mul(2).sum().item(), []),
    "host scalar with a device tensor": (lambda device: device * torch.tensor(2.0), []),
}


@pytest.mark.parametrize("case", SYNC_CASES)
def test_census_counts_what_cuda_would_wait_for(case):
    from loop_census import LoopCensus, _Dispatch, _Function

    fn, expected = SYNC_CASES[case]
    census = LoopCensus()
    census._window = {"epoch": 0, "batch_idx": 0, "global_step": 0, "marks": [], "found": []}
    device = torch.rand(4)
    with _Dispatch(census), _Function(census):
        fn(device)
    assert [kind for kind, _ in census._window["found"]] == expected, census._window["found"]


@pytest.mark.slow
@pytest.mark.distributed
def test_quickstart_loop_reads_nothing_between_syncs_under_ddp(tmp_path):
    """2 gloo processes: adds Lightning's SIGTERM broadcast, DDP's gradient reduction and synced BatchNorm."""
    data = images(tmp_path / "images", per_class=32)
    torchrun(WORKER, str(tmp_path), str(data), "2", str(STEPS), timeout=240)
    for rank in range(2):
        windows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        check(windows, f"rank {rank} of 2")
