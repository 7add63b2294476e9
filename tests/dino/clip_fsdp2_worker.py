"""DINOv3's per-submodule clip on FSDP2's sharded gradients: ``python clip_fsdp2_worker.py OUT_DIR`` under 2 gloo
processes. Each rank builds the same tiny student and the same whole gradients (one seed); the reference clips
an unsharded copy with ``torch.nn.utils.clip_grad_norm_`` per submodule (dinov3/train/train.py), the sharded
student with ``ssl_xcit.dino.optim.clip_per_module``. Each rank writes the gathered clipped gradients, the norms
and the norms a clip of the local shards alone would have seen (the defect this guards against)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.multicrop import MultiCropWrapper
from ssl_xcit.dino.optim import clip_per_module
from ssl_xcit.models import create_model

CLIP = 0.5  # below every submodule's norm: each is scaled


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    student = MultiCropWrapper(
        create_model("vit_tiny_patch16_224", depth=2, patch_size=8),
        DINOHead(192, 16, hidden_dim=16, bottleneck_dim=8),
        DINOHead(192, 12, hidden_dim=16, bottleneck_dim=8),
    )
    grads = {n: torch.randn(p.shape) for n, p in student.named_parameters() if p.requires_grad}
    reference = copy.deepcopy(student)
    for name, p in reference.named_parameters():
        p.grad = None if name not in grads else grads[name].clone()  # clip_grad_norm_ works in place
    expected = {
        n: float(torch.nn.utils.clip_grad_norm_(c.parameters(), CLIP)) for n, c in reference.named_children()
    }

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in student.children():
        fully_shard(child, mesh=mesh)
    local_norms = {}
    for name, p in student.named_parameters():
        if name in grads:
            assert isinstance(p, DTensor)
            p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements)
    for child_name, child in student.named_children():
        squares = sum(
            float(p.grad.to_local().float().square().sum()) for p in child.parameters() if p.grad is not None
        )
        local_norms[child_name] = squares**0.5
    norms = {n: float(v) for n, v in clip_per_module(student, CLIP).items()}
    clipped = {n: p.grad.full_tensor() for n, p in student.named_parameters() if p.grad is not None}
    reference_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    torch.save(
        {
            "norms": norms,
            "expected": expected,
            "local": local_norms,
            "clipped": clipped,
            "reference": reference_grads,
        },
        out / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
