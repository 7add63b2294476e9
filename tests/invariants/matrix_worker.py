"""Real ``fit`` runs of the invariant matrix: ``python matrix_worker.py OUT ROWS_JSON WORLD_SIZE [ACCELERATOR]``.

Under ``torchrun --nproc_per_node 2`` every row of ROWS_JSON (``matrix_options`` rows) runs as 2-process
Lightning DDP (gloo on the CPU, NCCL on CUDA), one row after another in the same processes; with WORLD_SIZE 1
the 1-process references. Each run is the DINO module (or ``Distill``), the recipe's callbacks (the synced
progress bar, skipped-images logger, quickstart's three ``ModelCheckpoint`` s, ``PreemptionCheckpoint``; the
module adds its collapse guard) and Lightning's loops, on the resumable loader the data module uses.

The 2-process runs of a row: ``full`` (under the loop census), ``crashed`` (rank 0 asks for a pre-emption in
the middle of window 1; ``PreemptionCheckpoint`` saves at a closed window and stops) and ``resumed`` (fit
from that checkpoint to the end). The 1-process runs: ``single`` (the same global batches, in one process),
``concat`` (accumulation 1 over batches of the concatenated micro-batches), ``twin`` (the other optimiser
implementation) and, for an FSDP2 row, ``ddp`` (the run under Lightning's default strategy). FSDP2 rows run
under their ``strategy`` (``matrix_strategy``); a row FSDP2 must refuse saves its one-line refusal instead. Each writes ``OUT/<row>/<run>_rank<r>.pt``: the module's and the optimiser's state, the
module's state at the start of training, losses, steps, census windows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

HERE = Path(__file__).resolve().parent
DINO_TESTS = HERE.parent / "dino"
MICRO = 2  # images per rank per micro-batch: a global micro-batch of 4
WORLD = 2  # the distributed runs' size; the references put the same global batch in one process
WINDOWS = 4  # optimiser windows in the run (one epoch)
SKIP_WINDOW = 1  # the window holding the unreadable micro-batch
PREEMPT_WINDOW = 1  # rank 0 asks for a pre-emption after this window's first micro-batch
# The CPU GradScaler's first scale. Its default, 2^16, overflows these gradients in float16, and each overflow
# skips the step and halves the scale: a 4-step run would never step. At 2^8 XCiT's float16 activation
# gradients (a true gradient norm near 2,300 here) overflow in some micro-batches and not in others, so whether
# a step is skipped depends on how the global batch is split over the ranks, and 2 processes cannot equal 1.
# 2^4 overflows in no row and still scales the gradients far past the clip threshold (3.0), as a real run's
# scale does, so a clip of scaled gradients is still caught.
SCALER_INIT = 2.0**4
# A row's GradScaler (``matrix_options.EXTRA_KEYS["scaler"]``): ``low`` starts at SCALER_INIT; ``overflow`` at torch's
# default 2^16, which overflows the first step's float16 gradients in every batch split, and backs off by 2^-12 to
# SCALER_INIT in one skipped step (the default halving would skip every step of a 4-step run), so the rows that
# start there skip exactly their first step on every rank and in every run, as a real run's first steps do.
SCALERS = {
    "low": {"init_scale": SCALER_INIT},
    "overflow": {"init_scale": 2.0**16, "backoff_factor": 2.0**-12},
}
CHECKPOINT_EVERY = 3  # the step ModelCheckpoint's interval (the quickstart's 10, scaled to a 4-step run)


def _load(name: str, path: Path) -> Any:
    """A module of tests/dino by path (its bare name ``conftest`` would collide with this suite's own)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def dino_fixtures() -> Any:
    return _load("dino_fixtures", DINO_TESTS / "conftest.py")


def census_module() -> Any:
    return _load("loop_census", DINO_TESTS / "loop_census.py")


def ddp_worker() -> Any:
    return _load("ddp_worker", DINO_TESTS / "ddp_worker.py")


# ------------------------------------------------------------------------------------------------- data
def skipped_micro_batches(row: dict[str, str]) -> list[int]:
    """The micro-batch indices (of the epoch) that every rank skips."""
    k, where = int(row["accumulate"]), row["unreadable"]
    first = SKIP_WINDOW * k
    if where == "none":
        return []
    if where == "start":
        return [first]
    if where in ("end", "one_rank"):
        return [first + k - 1]
    return list(range(first, first + k))


def readable_copy(row: dict[str, str]) -> str | None:
    """None when a window with a skipped micro-batch must step as the same window with a copy of its readable
    micro-batch in place of the skipped one (both are the readable micro-batch's gradient), else why not: only
    with one readable and one skipped micro-batch (k = 2) does a copy give the readable ones' mean, and iBOT's
    masks are drawn per micro-batch (a copy gets other masks)."""
    if row["unreadable"] not in ("start", "end", "one_rank"):
        return "no partly skipped window"
    if row["accumulate"] != "2":
        return f"k = {row['accumulate']}: no copy gives the readable ones' mean"
    if row["objective"] == "ibot":
        return "iBOT's masks are drawn per micro-batch"
    return None


def positions(row: dict[str, str], world_size: int) -> set[int]:
    """Positions in the epoch's sample order whose images are unreadable. Position ``p`` goes to rank
    ``p % WORLD`` of the 2-process run (the sampler's interleave), and global micro-batch ``m`` is positions
    ``4m .. 4m + 3`` in both runs. A micro-batch one rank skips, every rank skips: the 1-process reference
    makes its whole global micro-batch unreadable."""
    size = MICRO * WORLD
    found = {m * size + j for m in skipped_micro_batches(row) for j in range(size)}
    if row["unreadable"] == "one_rank" and world_size > 1:
        found = {p for p in found if p % WORLD == 1}
    return found


def dataset(row: dict[str, str], world_size: int, seed: int, duplicate: bool = False) -> Any:
    """ddp_worker's deterministic crops, ``WINDOWS`` windows long; the unreadable positions map to dataset
    indices through the sampler's own permutation (``ResumableSampler``: seed + epoch 0). ``duplicate``: no image
    is unreadable; each unreadable global micro-batch holds a copy of a readable one of its window instead,
    so the window's mean gradient is its readable micro-batches' mean (``skipped = readable mean``)."""
    crops = ddp_worker().FixedCrops
    n = WINDOWS * int(row["accumulate"]) * MICRO * WORLD
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    unreadable = frozenset(order[p] for p in positions(row, world_size))
    source = {}  # dataset index -> the index whose item it copies
    if duplicate:
        size, k = MICRO * WORLD, int(row["accumulate"])
        skipped = set(skipped_micro_batches(row))
        readable = [m for m in range(SKIP_WINDOW * k, SKIP_WINDOW * k + k) if m not in skipped]
        source = {order[m * size + j]: order[readable[0] * size + j] for m in skipped for j in range(size)}
        unreadable = frozenset()

    gram = row["objective"] == "gram"
    side = global_side(row)

    class Crops(crops):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> Any:
            item = super().__getitem__(source.get(i, i))
            if item is not None and side != GLOBAL_SIDE:  # larger global crops, drawn as FixedCrops draws
                views, *rest = item
                g = torch.Generator().manual_seed(2000 + source.get(i, i))
                views = [torch.randn(3, side, side, generator=g) + rest[0] for _ in views[:2]] + views[2:]
                item = (views, *rest)
            if item is None or not gram:
                return item
            # A model that anchors needs the Gram teacher's crops (gram_resolution_scale 1: the global crops'
            # own boxes, undistorted), as the datamodule cuts them.
            views, *rest = item
            return ({"crops": views, "gram_crops": [v.clone() for v in views[:2]]}, *rest)

    return Crops(unreadable)


GLOBAL_SIDE = 16  # FixedCrops' global crops (its local ones: 8 px)


def global_side(row: dict[str, str]) -> int:
    """The side of ``row``'s global crops: 16 px, times distillation's ``teacher_to_student_resolution_scale``
    (the teacher sees them whole, the student downsampled to 16 px: its 8 px patches still make a 2 x 2 grid)."""
    from matrix_options import setting

    scale = OPTIMS[setting(row, "optim")].get("teacher_to_student_resolution_scale", 1.0)
    return round(GLOBAL_SIDE * scale)


# ------------------------------------------------------------------------------------------------ model
def write_sources(out: Path, row: dict[str, str] | None = None) -> dict[str, Path]:
    """Tiny DINO checkpoints (Lightning layout, a DINO head included) of both backbones: ``init_from`` starts
    from the row's own backbone, distillation distils from the ViT (its ``dino`` objective needs the head).
    Every process writes its own copies (same tensors), so none reads a file another is writing. For a row with
    ``init_from_ema`` the source's teacher differs from its student, as a trained one does (a fresh DINO's
    teacher is a copy of its student, which would make the option a no-op)."""
    from matrix_options import setting

    from ssl_xcit.dino.module import DINO

    rank = os.environ.get("RANK", "single")
    ema = row is not None and OPTIMS[setting(row, "optim")].get("init_from_ema", False)
    paths = {}
    for norm, (backbone, kwargs) in BACKBONES.items():
        torch.manual_seed(7)
        source = DINO(backbone, backbone_kwargs=kwargs, **HEAD)
        if ema:
            with torch.no_grad():
                for p in source.teacher.parameters():
                    p.add_(0.1 * torch.randn_like(p))
        path = out / f"source_{norm}_{rank}.ckpt"
        torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, path)
        paths[norm] = path
    return paths


BACKBONES = {
    "xcit_syncbn": ("xcit_nano_12_p8", {"depth": 1}),
    "vit_nobn": ("vit_tiny_patch16_224", {"depth": 1, "patch_size": 8}),
}
HEAD = dict(out_dim=32, head_hidden_dim=32, head_bottleneck_dim=16)
OBJECTIVES: dict[str, dict[str, Any]] = {
    "dino": {},
    "koleo": {"koleo_weight": 0.1, "centering": "sinkhorn_knopp"},  # as the quickstart
    "ibot": {"ibot_loss_weight": 1.0, "centering": "sinkhorn_knopp"},
    "gram": {"gram_loss_weight": 1.0, "gram_start_step": 1},  # the EMA teacher of step 1 anchors steps 1-3
    "distill_features": {"objective": "features"},
    "distill_dino": {"objective": "dino"},
    "init_from": {"init_head_warmup_steps": 1},  # the backbone waits one step, then trains
}


def row_source(row: dict[str, str], sources: dict[str, Path]) -> str:
    return str(sources[row["norm"]])


# The optimiser column's settings. SGD (momentum 0.9) at a high learning rate moves the weights far in 4 steps, so
# that a disagreement stands out against float noise: AdamW's division by sqrt(v) turns noise on near-zero
# gradients into full-size steps. ``adamw`` is what users run: AdamW with the quickstart recipe's schedules
# (linear warm-up over the run's one epoch, weight decay 0.04 -> 0.1, teacher momentum 0.98), DINO's default
# one-epoch freeze of the head's last layer, and the automatic fused choice (fused under 16-mixed's GradScaler).
SGD = dict(optimizer="sgd", lr=2.0, warmup_epochs=0, momentum_teacher=0.9, freeze_last_layer=0)
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "foreach": {**SGD, "fused_optimizer": False},
    "fused": {**SGD, "fused_optimizer": True},
    "adamw": dict(optimizer="adamw", fused_optimizer=None, lr=0.008, min_lr=1e-5, warmup_epochs=1,
                  weight_decay=0.04, weight_decay_end=0.1, momentum_teacher=0.98, freeze_last_layer=1),
}  # fmt: skip


# The ``optim`` key (matrix_options.OPTIM_ROWS): DINO's optimisation (the model's defaults), DINOv3's options
# at values that make each one act within 4 steps (a decay of 0.5 per layer; the local pairs at half weight from
# the Gram term's start; a clip of 3 per submodule, below the SGD rows' gradient norms), or a newer option of the
# module's, each with the objective it acts in.
OPTIMS: dict[str, dict[str, Any]] = {
    "dino": {},
    "dinov3": dict(clip_mode="per_module", layerwise_decay=0.5, patch_embed_lr_mult=0.2,
                   lr_scaling_rule="sqrt_wrt_1024", final_momentum_teacher=0.9, local_crops_weight=0.5,
                   teacher_mode="eval", head_last_layer="linear"),
    # init_from (objective): the student starts from SOURCE's teacher too (write_sources makes it differ)
    "init_from_ema": dict(init_from_ema=True),
    # koleo (objective): one KoLeo group per global micro-batch (MICRO x WORLD), gathered across the ranks, at
    # 10 x DINOv2's weight: per-rank neighbours moved the gradients by 7.9e-2 at 0.1, inside bf16's tolerance
    "koleo_group": dict(koleo_group_size=MICRO * WORLD, koleo_weight=1.0),
    # distillation (objective): the student sees the global crops downsampled by 2 (global_side: 32 px crops)
    "teacher_to_student_2": dict(teacher_to_student_resolution_scale=2.0),
}  # fmt: skip


def build_model(row: dict[str, str], sources: dict[str, Path], fused: bool | None = None) -> Any:
    from ssl_xcit.dino.distill import Distill
    from ssl_xcit.dino.module import DINO

    backbone, kwargs = BACKBONES[row["norm"]]
    extra = dict(OBJECTIVES[row["objective"]])
    if row["objective"] == "init_from":
        extra["init_from"] = row_source(row, sources)
    L.seed_everything(0, verbose=False)
    from matrix_options import setting

    optimizer = dict(OPTIMIZERS[row["optimizer"]], **OPTIMS[setting(row, "optim")])
    if fused is not None:  # the fused = foreach column's twin
        optimizer["fused_optimizer"] = fused
    # An optim value wins over the objective's (koleo_group's weight).
    extra = {k: v for k, v in extra.items() if k not in optimizer}
    common = dict(
        backbone=backbone,
        backbone_kwargs=kwargs,
        drop_path_rate=0.0,  # its masks draw per rank: the 1- and 2-process runs would differ by design
        **optimizer,
        accumulate_grad_batches=int(row["accumulate"]),
        compile=row["compile"] != "off",
        sync_every_n_steps=1000,  # one read, at the epoch's end: the census sees the steady state
        **HEAD,
        **extra,
    )
    if row["objective"].startswith("distill_"):
        return Distill(teacher=str(sources["vit_nobn"]), **common)
    return DINO(**common)


# ---------------------------------------------------------------------------------------------- trainer
class Record(L.Callback):
    """Per micro-batch: the loss (None when skipped). With ``preempt``, rank 0 alone asks for a pre-emption
    (as its SIGTERM handler would) after window ``PREEMPT_WINDOW``'s first micro-batch."""

    def __init__(self, preempt: bool = False) -> None:
        self.losses: list[torch.Tensor | None] = []  # read after the fit: no host read of the census's
        self.scales: list[torch.Tensor] = []  # the GradScaler's scale after each micro-batch (16-mixed)
        self.preempt = preempt
        self.start: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer, pl_module):
        # After the module's on_fit_start (init_from's load): what training starts from, whole (every rank).
        from matrix_strategy import module_state

        self.start = module_state(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(None if loss is None else loss.detach().clone())
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler._scale is not None:  # get_scale() would be a host read
            self.scales.append(scaler._scale.detach().clone())
        k = pl_module.hparams.accumulate_grad_batches
        if self.preempt and batch_idx == PREEMPT_WINDOW * k and trainer.global_rank == 0:
            from ssl_xcit.trainer.preemption import PreemptionCheckpoint

            for callback in trainer.callbacks:
                if isinstance(callback, PreemptionCheckpoint):
                    callback.received = signal.SIGTERM


class Gradients(L.Callback):
    """Each optimiser step's student gradients as the callbacks' ``on_before_optimizer_step`` sees them: reduced
    over the ranks, the mean over the window's readable micro-batches, in true units (unscaled), before the clip.
    Compared window by window, where nothing dilutes an error: a doubled window gradient is a difference of 1,
    which the clip (it caps each norm at 3) and the weights' accumulated float noise hide in the weights. Local
    shards under FSDP2 (no gather inside the censused step), with whether each is sharded."""

    def __init__(self) -> None:
        self.windows: list[dict[str, tuple[torch.Tensor, bool]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from torch.distributed.tensor import DTensor

        self.windows.append({
            name: (_local(p.grad).detach().float().clone(), isinstance(p.grad, DTensor))
            for name, p in pl_module.student.named_parameters() if p.grad is not None
        })  # fmt: skip


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def callbacks(out: Path) -> list[L.Callback]:
    """The quickstart recipe's callbacks (its online k-NN aside: it needs a labelled validation set and
    runs at the epoch's end, outside the steady state) and the CLI's ``PreemptionCheckpoint``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ssl_xcit.data import SkippedImagesLogger
    from ssl_xcit.trainer.preemption import PreemptionCheckpoint
    from ssl_xcit.trainer.progress import SyncedRichProgressBar

    folder = dict(dirpath=out / "checkpoints", enable_version_counter=False)
    return [
        SyncedRichProgressBar(),
        SkippedImagesLogger(),
        ModelCheckpoint(filename="last", every_n_train_steps=CHECKPOINT_EVERY, **folder),
        ModelCheckpoint(filename="last", every_n_epochs=1, save_on_train_epoch_end=True, **folder),
        ModelCheckpoint(filename="{epoch:04d}", every_n_epochs=2, save_top_k=-1, save_on_train_epoch_end=True,
                        dirpath=out / "checkpoints"),
        PreemptionCheckpoint(requeue=False),
    ]  # fmt: skip


def fit(row: dict, out: Path, world_size: int, accelerator: str, sources: dict, *, batch: int = MICRO,
        fused: bool | None = None, preempt: bool = False, ckpt_path: Path | None = None,
        census: bool = False, data_row: dict | None = None, strategy: str | None = None,
        duplicate: bool = False) -> dict[str, Any]:  # fmt: skip
    """One fit of ``row`` (under ``strategy``, else the row's); its state, gradients, losses and census
    windows. ``duplicate``: the unreadable images are replaced by copies (``dataset``)."""
    from lightning.pytorch.loggers import CSVLogger
    from matrix_options import setting
    from matrix_strategy import local_state, module_state, optimizer_state, precision_args, trainer_strategy

    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.data.resumable import resumable_loader
    from ssl_xcit.trainer.preemption import Preempted

    if row["compile"] != "off":
        _compile_backend(row["compile"])
    model = build_model(row, sources, fused)
    rank = int(os.environ.get("RANK", "0"))
    record, gradients = Record(preempt), Gradients()
    trainer = L.Trainer(
        accelerator=accelerator, devices=world_size, strategy=strategy or trainer_strategy(row, world_size),
        max_epochs=1, logger=CSVLogger(out, name="csv"), log_every_n_steps=50, num_sanity_val_steps=0,
        enable_model_summary=False, callbacks=[record, gradients, *callbacks(out)], default_root_dir=out,
        **precision_args(row["precision"], accelerator, setting(row, "scaler")),
    )  # fmt: skip
    data = dataset(data_row or row, world_size, seed=0, duplicate=duplicate)
    loader = resumable_loader(data, batch, collate_train, world_size=world_size, rank=rank, seed=0)
    found = census_module().LoopCensus() if census else None
    stopped = None
    try:
        if found is not None:
            with found.installed():
                trainer.fit(model, loader, ckpt_path=ckpt_path)
        else:
            trainer.fit(model, loader, ckpt_path=ckpt_path)
    except Preempted as err:
        stopped = str(err.checkpoint)
    return {
        "state": module_state(model),  # whole tensors: FSDP2's shards gathered
        "start": record.start,  # the same at the start of training
        "optimizer": optimizer_state(trainer.optimizers[0]),
        "local": local_state(model, trainer.optimizers[0]),  # this rank's own shards (FSDP2) and tensors
        "gradients": gradients.windows,
        "losses": [None if x is None else float(x) for x in record.losses],
        "scaler_skips": scaler_skips(record.scales),
        "global_step": trainer.global_step,
        "skipped": model.skipped_batches,
        "preempted": stopped,
        "census": found.windows if found is not None else None,
        "world_size": trainer.world_size,
        "bn_types": sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__}),
    }


def scaler_skips(scales: list[torch.Tensor]) -> int | None:
    """How many optimiser steps the GradScaler skipped (found inf/NaN gradients): each skip halves its scale,
    and the scale only grows after 2000 clean steps. None without a scaler. A resumed run counts from
    ``SCALER_INIT``, not its checkpoint's scale: a diagnostic for the table's detail, not an invariant."""
    if not scales:
        return None
    values = [SCALER_INIT, *(float(s) for s in scales)]
    return sum(after < before for before, after in zip(values[:-1], values[1:], strict=True))


def initial_state(row: dict, sources: dict) -> dict[str, torch.Tensor]:
    """The module's state before training (after ``init_from``'s load where the row has one; with
    ``init_from_ema`` the student from SOURCE's teacher: ``init_from._from_ema`` written out here, so that a
    defect there does not move the expectation too)."""
    from dataclasses import replace

    from matrix_options import setting

    model = build_model(row, sources, fused=False)
    if row["objective"] == "init_from":
        from ssl_xcit.dino.init_from import apply_weights, read_source

        weights = read_source(row_source(row, sources))
        if OPTIMS[setting(row, "optim")].get("init_from_ema"):
            weights = replace(weights, student=weights.teacher)
        apply_weights(model, weights)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


_COMPILE = torch.compile


def _compile_backend(backend: str) -> None:
    """``torch.compile`` with ``backend`` (``aot_eager``: the graphs inductor would get, made on 2 CPU cores in
    seconds; ``inductor``: the kernels users get). The fits of a launch share dynamo's cache (a new module of a
    shape compiled before reuses its graphs: the compile is paid once, not per fit); the rows' models add
    entries, so the recompile limit is raised, and reaching it fails the row instead of running it eager."""
    import torch._dynamo

    def compile_with_backend(fn=None, **kwargs):
        return _COMPILE(fn, **{**kwargs, "backend": backend})

    torch.compile = compile_with_backend
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def censused_fit(
    row: dict, folder: Path, name: str, world_size: int, accelerator: str, sources: dict, **kwargs: Any
) -> dict[str, dict]:
    """``{name: fit}`` under the loop census; with compile, the census in a fit of its own (``"census"``).
    The census's dispatch mode makes dynamo run every compiled frame eagerly, and eager XCiT differs from its
    ``aot_eager`` graphs in the last bits: a censused run is no reference for compiled runs (docs/invariants.md)."""
    if row["compile"] == "off":
        return {name: fit(row, folder / name, world_size, accelerator, sources, census=True, **kwargs)}
    return {
        name: fit(row, folder / name, world_size, accelerator, sources, **kwargs),
        "census": fit(row, folder / "census", world_size, accelerator, sources, census=True, **kwargs),
    }


def uninterrupted_and_resumed(row: dict, folder: Path, world_size: int, accelerator: str,
                              sources: dict) -> dict[str, dict]:  # fmt: skip
    """The uninterrupted run (``full``, censused), one pre-empted mid-window (``crashed``) and its resume."""
    runs = censused_fit(row, folder, "full", world_size, accelerator, sources)
    runs["crashed"] = fit(row, folder / "crashed", world_size, accelerator, sources, preempt=True)
    ckpt = runs["crashed"]["preempted"]
    if ckpt is not None:
        runs["resumed"] = fit(row, folder / "resumed", world_size, accelerator, sources, ckpt_path=Path(ckpt))
    return runs


def run_row(row: dict, out: Path, world_size: int, accelerator: str = "cpu") -> None:
    """Every run of ``row`` that ``world_size`` makes (see the module docstring), saved under ``out``; a row
    that must be refused (``matrix_options.expected_refusal``) saves the refusal instead."""
    from matrix_options import accumulation_exact, row_id
    from matrix_options import strategy as strategy_of

    folder = out / row_id(row)
    folder.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    sources = write_sources(folder, row)
    runs: dict[str, dict] = {}
    try:
        if world_size > 1:
            runs.update(uninterrupted_and_resumed(row, folder, world_size, accelerator, sources))
        else:
            runs["initial"] = {"state": initial_state(row, sources)}
            runs.update(censused_fit(row, folder, "single", 1, accelerator, sources, batch=MICRO * WORLD))
            k = int(row["accumulate"])
            if accumulation_exact(row) is None:
                concat = {**row, "accumulate": "1"}
                runs["concat"] = fit(
                    concat, folder / "concat", 1, accelerator, sources, batch=MICRO * WORLD * k, data_row=row
                )
            if readable_copy(row) is None:  # the same run with copies in place of the unreadable images
                runs["readable"] = fit(row, folder / "readable", 1, accelerator, sources, batch=MICRO * WORLD,
                                       duplicate=True)  # fmt: skip
            if row["optimizer"] == "fused":  # the same run with torch's default implementation
                runs["twin"] = fit(
                    row, folder / "twin", 1, accelerator, sources, batch=MICRO * WORLD, fused=False
                )
            if strategy_of(row) != "ddp":  # the same run under Lightning's default strategy
                runs["ddp"] = fit(row, folder / "ddp", 1, accelerator, sources, batch=MICRO * WORLD,
                                  strategy="auto")  # fmt: skip
    except Exception as err:  # one broken row is a failed row, never the end of the matrix
        import traceback

        from matrix_strategy import refusal

        refused = refusal(row, err)
        if refused is not None:  # every rank refuses at the same point, before any collective of the fit
            torch.save(refused, folder / f"ws{world_size}_rank{rank}.pt")
            return
        runs["error"] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-4000:]}
        if world_size > 1:  # the other rank may wait in a collective this one left: end both now
            torch.save(runs, folder / f"ws{world_size}_rank{rank}.pt")
            os._exit(3)
    torch.save(runs, folder / f"ws{world_size}_rank{rank}.pt")


def main(out: Path, rows: list[dict], world_size: int, accelerator: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from matrix_options import row_id

    if os.environ.get("MATRIX_MUTANT"):  # a seeded defect (mutants.py), in every process of the launch
        import mutants

        mutants.apply(os.environ["MATRIX_MUTANT"])

    for row in rows:
        start = time.perf_counter()
        run_row(row, out, world_size, accelerator)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(out / "timings.txt", "a") as log:
                log.write(f"{row_id(row)} ws{world_size}: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[3]),
         sys.argv[4] if len(sys.argv) > 4 else "cpu")  # fmt: skip
