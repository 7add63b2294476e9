"""The FSDP2 start of each case built on the meta device and built whole, on 2 gloo processes:
``python fsdp2_meta_start_worker.py OUT_DIR CASE[,CASE...]`` writes OUT_DIR/<case>/rank<r>.pt with, for each
start (``meta``: ``meta_start()``, then configure_model materialises the shards; ``whole``: built whole, then
sharded; ``plain``: built whole, no trainer), the student's, teacher's and Gram teacher's whole tensors and the
first draw of the RNG after the networks exist (``test_fsdp2_meta_start.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

HEAD = dict(out_dim=32, head_hidden_dim=32, head_bottleneck_dim=16)
# (backbone, backbone_kwargs, DINO overrides): the quickstart's backbone, each family, XCiT with iBOT and Gram.
CASES: dict[str, tuple[str, dict, dict[str, Any]]] = {
    "quickstart": ("xcit_nano_12_p8", {"depth": 2}, {}),
    "vit": ("vit_tiny_patch16_224", {"depth": 2, "patch_size": 8}, {"ibot_loss_weight": 1.0}),
    "cait": ("cait_xxs24", {"depth": 1, "patch_size": 8}, {}),
    "convnext": ("convnext_atto", {}, {}),
    "crossformerpp": ("crossformerpp_small", {"depths": (1, 1, 1, 1)}, {}),
    "bixt": ("bixt_ti_l64_p16", {"depth": 2}, {}),
    "dinov3": ("vit_small_patch16_dinov3", {"depth": 2}, {"ibot_loss_weight": 1.0}),
    "gram_ibot": ("xcit_nano_12_p8", {"depth": 1}, {"ibot_loss_weight": 1.0, "gram_loss_weight": 1.0}),
    # A fixed Gram teacher read from a file (SOURCE_FILE, written by the worker), memory-mapped into the shards.
    "gram_source": ("xcit_nano_12_p8", {"depth": 1}, {"gram_loss_weight": 1.0}),
}
SOURCE_FILE = "gram_source_rank{rank}.safetensors"


def build(case: str, source: Path | None = None):
    from ssl_xcit.dino.module import DINO

    backbone, kwargs, overrides = CASES[case]
    if source is not None:
        overrides = {**overrides, "gram_teacher": str(source)}
    L.seed_everything(0, verbose=False)
    return DINO(backbone, backbone_kwargs=kwargs, drop_path_rate=0.1, **HEAD, **overrides)


def write_source(case: str, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A backbone of the case's architecture with other weights (seed 7), saved as safetensors (each rank its
    own copy: no rank reads a file another is writing); its state."""
    from safetensors.torch import save_file

    from ssl_xcit.models import create_model

    backbone, kwargs, _ = CASES[case]
    torch.manual_seed(7)
    state = {k: v.contiguous() for k, v in create_model(backbone, **kwargs).state_dict().items()}
    path = out / SOURCE_FILE.format(rank=torch.distributed.get_rank())
    save_file(state, str(path))
    return path, state


def networks(model: Any) -> dict[str, dict[str, torch.Tensor]]:
    from ssl_xcit.parallel.fsdp import whole_state_dict

    nets = {"student": model.student, "teacher": model.teacher}
    if model.gram_teacher is not None:
        nets["gram"] = model.gram_teacher
    return {name: whole_state_dict(net) for name, net in nets.items()}


class AtFitStart(L.Callback):
    """The networks (gathered) and the RNG's next draw once the strategy has set the model up."""

    result: dict[str, Any] = {}

    def on_fit_start(self, trainer, pl_module):
        self.result = {
            "nets": networks(pl_module),
            "draw": torch.rand(4),
            "types": sorted({type(p).__name__ for p in pl_module.parameters()}),
            "devices": sorted({str(t.device) for t in pl_module.state_dict().values()}),
        }


def write_teacher(out: Path) -> Path:
    """A tiny DINO run of ours (ViT-Ti/8, 2 blocks) as its Lightning checkpoint lays it out: a distillation's
    teacher (each rank its own copy)."""
    from ssl_xcit.dino.module import DINO

    torch.manual_seed(5)
    dino = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 2, "patch_size": 8}, **HEAD)
    path = out / f"teacher_rank{torch.distributed.get_rank()}.ckpt"
    torch.save({"state_dict": dino.state_dict(), "hyper_parameters": dict(dino.hparams)}, path)
    return path


def distill(teacher: Path, meta: bool) -> dict[str, Any]:
    """Distillation (the dino objective: the teacher's heads too) from ``teacher`` up to the fit's start; the
    frozen teacher's whole tensors after setup."""
    from ssl_xcit.dino.distill import Distill
    from ssl_xcit.parallel.fsdp import whole_state_dict
    from ssl_xcit.parallel.meta_start import meta_start

    L.seed_everything(0, verbose=False)
    with meta_start(meta):
        model = Distill(teacher=str(teacher), objective="dino", backbone="xcit_nano_12_p8",
                        backbone_kwargs={"depth": 1}, head_hidden_dim=32, head_bottleneck_dim=16)  # fmt: skip
    on_meta = all(p.is_meta for p in model.teacher.backbone.parameters())
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_epochs=1, limit_train_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(model, DataLoader(range(4)))
    types = sorted({type(p).__name__ for p in model.teacher.backbone.parameters()})
    return {"teacher": whole_state_dict(model.teacher), "on_meta": on_meta, "types": types}


def start(case: str, meta: bool, source: Path | None = None) -> dict[str, Any]:
    from ssl_xcit.parallel.fsdp import whole_state_dict
    from ssl_xcit.parallel.meta_start import meta_start

    with meta_start(meta):
        model = build(case, source)
    built_on_meta = all(p.is_meta for p in model.student.parameters())
    record = AtFitStart()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_epochs=1, limit_train_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record])  # fmt: skip
    trainer.fit(model, DataLoader(range(4)))
    after = {}
    if source is not None:  # read at fit start, after the callback's look
        after = {
            "gram_after": whole_state_dict(model.gram_teacher.backbone),
            "initialised": model.gram_teacher.initialised,
        }
    return {**record.result, **after, "built_on_meta": built_on_meta}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.distributed.init_process_group("gloo")  # Lightning reuses it
    for case in sys.argv[2].split(","):
        if case == "distill":  # the frozen teacher read into the shards, or whole then sharded
            path = write_teacher(out)
            source = torch.load(path, weights_only=False)["state_dict"]
            result = {"source": {k[len("teacher.") :]: v for k, v in source.items() if k.startswith("teacher.")},
                      "meta": distill(path, meta=True), "whole": distill(path, meta=False)}  # fmt: skip
            (out / case).mkdir(parents=True, exist_ok=True)
            torch.save(result, out / case / f"rank{torch.distributed.get_rank()}.pt")
            continue
        if case == "gram_source":
            path, state = write_source(case, out)
            meta = start(case, meta=True, source=path)
            result = {"source": state, "meta": meta}
            (out / case).mkdir(parents=True, exist_ok=True)
            torch.save(result, out / case / f"rank{torch.distributed.get_rank()}.pt")
            continue
        model = build(case)
        plain = {"nets": networks(model), "draw": torch.rand(4)}
        result = {"plain": plain, "whole": start(case, meta=False), "meta": start(case, meta=True)}
        (out / case).mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank()
        torch.save(result, out / case / f"rank{rank}.pt")
