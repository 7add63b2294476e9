"""``ssl-xcit export CKPT OUT``: the teacher backbone of a DINO checkpoint, with the recipe that builds it.

The file is ``{"state_dict": ..., "hyper_parameters": {"backbone": name, "backbone_kwargs": {...}}}``: the
state dict has the family's timm parameter names (no prefix, no DINO head), so ``torch.load(out)["state_dict"]``
loads with ``strict=True`` into ``ssl_xcit.models.create_model(name, **backbone_kwargs)`` and into the matching
timm model; ``build_backbone(out)`` rebuilds the exact architecture (non-default options such as
``tokens_norm`` or a truncated ``depth`` included) from the recorded name and arguments.
The teacher is exported because it is the better network (the DINO authors corrected their first XCiT
backbone releases from student to teacher weights, dino#79).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ssl_xcit.errors import UserError
from ssl_xcit.utils.io import atomic_torch_save, owner_only

TEACHER_PREFIX = "teacher.backbone."


def teacher_backbone_state(checkpoint: dict[str, Any], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """``teacher.backbone.*`` of a Lightning DINO checkpoint, prefix removed."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        keys = list(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise UserError(f"{source} is not a Lightning checkpoint (no 'state_dict'); top-level keys: {keys}")
    out = {k[len(TEACHER_PREFIX) :]: v for k, v in state.items() if k.startswith(TEACHER_PREFIX)}
    if not out:
        prefixes = sorted({k.split(".")[0] for k in state})
        raise UserError(
            f"{source} has no teacher backbone (no '{TEACHER_PREFIX}*' keys; top-level modules: {prefixes}); "
            "export needs a checkpoint of ssl_xcit.dino.module.DINO"
        )
    return out


def export_teacher(checkpoint_path: str | Path, out_path: str | Path) -> tuple[Path, str]:
    """Write the teacher backbone of ``checkpoint_path`` and its name and ``backbone_kwargs`` to ``out_path``
    (atomically); returns (path, model name). The state dict is loaded strictly into a freshly built model
    first, so a bad export never lands."""
    from ssl_xcit.models import create_model, read_checkpoint

    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint_path} does not exist")
    checkpoint = read_checkpoint(checkpoint_path)
    state = teacher_backbone_state(checkpoint, str(checkpoint_path))
    hparams = checkpoint.get("hyper_parameters") or {}
    name = hparams.get("backbone")
    if not isinstance(name, str):
        raise UserError(f"{checkpoint_path} does not record its backbone name (hyper_parameters['backbone'])")
    kwargs = dict(hparams.get("backbone_kwargs") or {})
    model = create_model(name, **kwargs)
    # iBOT's mask token is a training input, not part of the network one evaluates: the export leaves it out.
    state.pop("mask_token", None)
    model.load_state_dict(state, strict=True)
    # Plain contiguous CPU tensors, in the model's own key order.
    plain = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    # Only the architecture arguments: training-time ones (drop_path_rate) do not describe the weights.
    arch = {k: v for k, v in kwargs.items() if k != "drop_path_rate"}
    record = {"state_dict": plain, "hyper_parameters": {"backbone": model.name, "backbone_kwargs": arch}}
    return atomic_torch_save(record, out_path, private=owner_only()), name


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(
        prog="ssl-xcit export",
        description="Export the teacher backbone of a DINO checkpoint (timm-compatible state dict + its model name).",
    )
    parser.add_argument(
        "checkpoint",
        help="Lightning checkpoint of a DINO run (e.g. runs/quickstart/version_0/checkpoints/last.ckpt)",
    )
    parser.add_argument("out", help="output .pth file (written atomically)")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        path, name = export_teacher(args.checkpoint, args.out)
    except (FileNotFoundError, UserError) as err:
        parser.exit(2, f"ssl-xcit export: error: {err}\n")
    print(f"exported the teacher backbone ({name}) of {args.checkpoint} to {path}")
    return {"out": str(path), "model": name}
