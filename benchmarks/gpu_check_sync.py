"""gpu_check's host-sync rows (``benchmarks/gpu_check.py`` runs them; ``host`` is that script's module, for its
``Row``, recipe and helpers; ``sync_count.py`` counts)."""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any

import torch


def _recipe_progress_bar(recipe: Any) -> Any:
    """The progress bar the quickstart recipe names (its ``callbacks`` entry), made with its arguments."""

    import yaml

    for entry in yaml.safe_load(recipe.read_text())["trainer"]["callbacks"]:
        if "ProgressBar" in entry["class_path"]:
            module, name = entry["class_path"].rsplit(".", 1)
            return getattr(importlib.import_module(module), name)(**(entry.get("init_args") or {}))
    raise ValueError(f"{recipe.name} names no progress bar")


def sync_row(
    host: Any, check: Any, progress_bar: bool = False, precision: str | None = None, measured: int = 0
) -> Any:
    """Host syncs per step of the quickstart's model and data, after 2 warm-up steps (``sync_count.py``: per
    iteration of Lightning's epoch loop, logging included). Passes when at most one step in ``k`` syncs, ``k``
    being the logging interval (and ``sync_every_n_steps`` where DINO has it); the result names each site
    (``file:line`` of the innermost ssl_xcit or Lightning frame) with its count. With ``progress_bar``, the
    recipe's bar is on (the other row turns it off, as the throughput benchmark does). ``precision`` replaces
    the base precision: ``16-mixed`` runs with its GradScaler (on the CPU torch's CPU scaler through a plugin,
    and a 1-block ViT: the recipe's XCiT has non-finite float16 gradients there) and the toolkit's default
    optimiser for it (fused AdamW, whose step reads no ``found_inf`` on the host). ``measured``: steps counted
    (12, the dry run's 4). The dry run counts with the loop census, which counts what CUDA would: its row says
    n/a (nothing waits on a CPU) with those figures, and fails when they exceed the allowance."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from ssl_xcit.data.datamodule import DINODataModule
    from ssl_xcit.dino.module import DINO

    sync_count = host._load("sync_count")
    counter = sync_count.SyncCounter(skip=2)
    k = 4
    measured = measured or (4 if check.dry else 12)
    model_kw, data_kw = host._quickstart_kwargs(check)
    if check.dry:  # whole measured windows: one more batch after them (the epoch's end is in the last one)
        folder = check.tmp / f"sync_images_{measured}"
        data_kw = {**data_kw, "root": str(host.tiny_images(folder, data_kw["batch_size"] * (measured + 3)))}
    setting = f"after 2 steps, {measured} steps, logging every {k}"
    bar = _recipe_progress_bar(host.RECIPE) if progress_bar else None
    if "sync_every_n_steps" in inspect.signature(DINO).parameters:  # only where the module has the setting
        model_kw = {**model_kw, "sync_every_n_steps": k}
        setting += f", sync_every_n_steps {k}"
    if bar is not None:
        setting += f", {type(bar).__name__}"
    precision_kw: dict = {"precision": precision or check.base_precision}
    if precision is not None:
        setting += f", {precision}"
    if precision == "16-mixed" and check.dry:
        from lightning.pytorch.plugins import MixedPrecision

        precision_kw = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
        model_kw = {**model_kw, "backbone": "vit_tiny_patch16_224",
                    "backbone_kwargs": {"depth": 1, "patch_size": 8}}  # fmt: skip
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator=check.accelerator, devices=1, **precision_kw, max_epochs=1,
        limit_train_batches=2 + measured + 1, limit_val_batches=0, num_sanity_val_steps=0,
        logger=CSVLogger(check.tmp / "sync_logs"), log_every_n_steps=k, enable_checkpointing=False,
        enable_progress_bar=bar is not None, enable_model_summary=False,
        callbacks=[counter] if bar is None else [counter, bar],
    )  # fmt: skip
    trainer.fit(DINO(**{**model_kw, "collapse_guard": "off"}), DINODataModule(**data_kw))
    name = "host syncs per step" + (" (progress bar on)" if bar is not None else "")
    name += f" ({precision})" if precision is not None else ""
    windows = counter.steps()[:measured]
    steps = [len(w["found"]) for w in windows]
    syncing = sum(n > 0 for n in steps)
    allowed = math.ceil(len(steps) / k)
    ok = len(steps) == measured and syncing <= allowed
    result = f"{sum(steps)} syncs in {len(steps)} steps, {syncing} steps sync (allowed {allowed})"
    result += f" [{' '.join(map(str, steps))}]; {counter.method}"
    found = sync_count.sites(windows)
    result += "; sites: " + (", ".join(f"{site} x{n}" for site, n in found.most_common()) or "none")
    if check.dry:  # nothing waits on a CPU: the census's figures are what CUDA would count
        return host.Row(name, setting, f"n/a on a CPU ({result})", "skip" if ok else "fail")
    return host.Row(name, setting, result, "pass" if ok else "fail")
