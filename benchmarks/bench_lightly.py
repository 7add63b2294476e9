"""Our DINO against lightly's DINO: same backbone, same start weights, same data, steps and hyper-parameters.

    pip install -e ".[bench]"    # installs lightly (an optional extra, never a runtime dependency)
    python benchmarks/bench_lightly.py --recipe recipes/quickstart.yaml --data synthetic --epochs 3
    python benchmarks/bench_lightly.py --recipe recipes/small_dataset.yaml --data flowers5 --limit-batches 20

Settings come from a recipe YAML plus ``--data/--epochs/--limit-batches/--set/--data-set`` exactly as in
``benchmarks/learning.py`` (whose ``settings()`` this script calls), so the comparison follows the recipes.

Ours: ``ssl_xcit.dino.module.DINO`` + ``ssl_xcit.data.DINODataModule`` under a Lightning Trainer.
lightly: a plain PyTorch loop in the shape of lightly's documented DINO example: student = backbone +
``DINOProjectionHead``, teacher = ``deepcopy`` of the student with ``deactivate_requires_grad``, lightly's
``DINOLoss`` over all views (teacher on the 2 global views, one forward per view), ``DINOTransform`` views,
``cancel_last_layer_gradients`` for the last-layer freeze, ``update_momentum`` with lightly's ``cosine_schedule``.
Shared on purpose: the backbone (``ssl_xcit.models.create_model``) and the start weights (lightly's student is
loaded from ours, so random init is one number), the image files and k-NN split, AdamW with our parameter
groups (no decay on biases and 1-D tensors), our per-iteration lr / weight-decay schedules, our per-parameter
gradient clipping, and the evaluation: DINO's weighted k-NN (k 20, T 0.07) on the teacher backbone's
embedding with the datamodule's eval transform.

Where lightly differs or lacks a feature (printed with the results):
- ``DINOLoss`` has only ``center_mode="mean"`` (EMA centring); no Sinkhorn-Knopp, and the DINO example has no
  KoLeo term. A recipe with ``centering: sinkhorn_knopp`` or ``koleo_weight > 0`` is run for ours twice: as in
  the recipe, and with ``ema`` and no KoLeo (exactly lightly's feature set).
- ``DINOProjectionHead`` is fixed at 3 layers (head_nlayers must be 3), and its hidden Linear layers have no
  bias when BatchNorm follows (a bias before BN is cancelled by it; the start weights are otherwise equal).
- ``DINOTransform`` cannot solarize the first global crop or the local crops, and its second global crop
  ignores ``cj_strength`` (lightly 1.6 uses the default 0.5 there); the jitter strengths are therefore given as
  ``cj_strength=0.5`` times doubled values, which is the configured jitter on every view.
- The teacher backbone is a deepcopy of the student's, so its drop path is switched off after the copy (as ours and the
  official DINO have it); the EMA runs after the optimiser step with the momentum of that step.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from ssl_xcit.cli.quiet import install_filters
from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.datasets import ImageDataset, collate_skip_none, collate_train
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.optim import clip_gradients, get_params_groups
from ssl_xcit.dino.schedules import cosine_schedule, scaled_lr
from ssl_xcit.evaluation.knn import weighted_knn
from ssl_xcit.models import create_model

HERE = Path(__file__).resolve().parent
K, T = 20, 0.07


def _learning():
    """benchmarks/learning.py as a module (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location("ssl_xcit_bench_learning", HERE / "learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="synthetic", help="synthetic | flowers5 | cifar10 | an ImageFolder path")
    p.add_argument(
        "--recipe", default="recipes/quickstart.yaml", help="model and data settings from this YAML"
    )
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the recipe's)")
    p.add_argument("--limit-batches", type=int, default=None, help="steps per epoch (default: whole epochs)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="DINO model argument")
    p.add_argument("--data-set", action="append", default=[], metavar="KEY=VALUE", help="datamodule argument")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- hyper-parameters
HP_KEYS = (
    "backbone", "backbone_kwargs", "drop_path_rate", "out_dim", "head_hidden_dim", "head_bottleneck_dim",
    "head_nlayers", "use_bn_in_head", "norm_last_layer", "warmup_teacher_temp", "teacher_temp",
    "warmup_teacher_temp_epochs", "student_temp", "center_momentum", "centering", "koleo_weight", "momentum_teacher", "lr",
    "min_lr", "warmup_epochs", "weight_decay", "weight_decay_end", "clip_grad", "freeze_last_layer",
)  # fmt: skip
CROP_KEYS = (
    "global_crops_size", "global_crops_scale", "local_crops_number", "local_crops_size", "local_crops_scale",
    "global_blur_probs", "local_blur_prob", "global_solarize_probs", "local_solarize_prob", "blur_radius",
    "flip_prob", "color_jitter", "color_jitter_prob", "grayscale_prob", "mean", "std",
)  # fmt: skip


def ours_hparams(model: DINO, dm: DINODataModule, epochs: int, steps_per_epoch: int) -> dict[str, Any]:
    """The resolved settings of our run (defaults included): model, crops, batch and schedule length."""
    hp = {k: model.hparams[k] for k in HP_KEYS}
    hp["backbone_kwargs"] = dict(hp["backbone_kwargs"] or {})
    crops = dm.crop_config
    hp.update({k: tuple(crops[k]) if isinstance(crops[k], (list, tuple)) else crops[k] for k in CROP_KEYS})
    batch = dm.hparams.batch_size
    peak = scaled_lr(model.hparams.lr, batch) if model.hparams.scale_lr_with_batch else model.hparams.lr
    hp.update(batch_size=batch, epochs=epochs, steps_per_epoch=steps_per_epoch, peak_lr=peak)
    return hp


def check_lightly_can(hp: dict[str, Any]) -> None:
    """Settings lightly's DINO cannot express, as a clear error."""
    if hp["head_nlayers"] != 3:
        raise ValueError(f"lightly's DINOProjectionHead has 3 layers; head_nlayers={hp['head_nlayers']}")
    if hp["global_solarize_probs"][0] or hp["local_solarize_prob"]:
        raise ValueError(
            "lightly's DINOTransform solarizes the second global crop only; got global_solarize_probs="
            f"{hp['global_solarize_probs']} and local_solarize_prob={hp['local_solarize_prob']}"
        )


# ------------------------------------------------------------------------------------------- lightly side
def lightly_transform(hp: dict[str, Any]):
    from lightly.transforms.dino_transform import DINOTransform

    b, c, s, h = hp["color_jitter"]
    # lightly 1.6 multiplies the jitter by cj_strength, except on the second global view, where it uses the
    # default 0.5: with 0.5 everywhere and doubled strengths every view gets exactly (b, c, s, h).
    return DINOTransform(
        global_crop_size=hp["global_crops_size"],
        global_crop_scale=tuple(hp["global_crops_scale"]),
        local_crop_size=hp["local_crops_size"],
        local_crop_scale=tuple(hp["local_crops_scale"]),
        n_local_views=hp["local_crops_number"],
        hf_prob=hp["flip_prob"],
        cj_prob=hp["color_jitter_prob"],
        cj_strength=0.5,
        cj_bright=2 * b,
        cj_contrast=2 * c,
        cj_sat=2 * s,
        cj_hue=2 * h,
        random_gray_scale=hp["grayscale_prob"],
        gaussian_blur=(*hp["global_blur_probs"], hp["local_blur_prob"]),
        sigmas=tuple(hp["blur_radius"]),
        solarization_prob=hp["global_solarize_probs"][1],
        normalize={"mean": list(hp["mean"]), "std": list(hp["std"])},
    )


def _copy_head(ours: nn.Module, theirs: nn.Module) -> None:
    """Our DINOHead's weights into lightly's DINOProjectionHead (same layers in the same order; lightly has
    no Linear bias before a BatchNorm, which cancels such a bias anyway)."""
    kinds = (nn.Linear, nn.BatchNorm1d)
    mine = [m for m in ours.mlp.modules() if isinstance(m, kinds)]
    other = [m for m in theirs.layers.modules() if isinstance(m, kinds)]
    if [type(m) for m in mine] != [type(m) for m in other]:
        raise ValueError("our head and lightly's head have different layers")
    with torch.no_grad():
        for a, b in zip(mine, other, strict=True):
            for name, tensor in [*b.named_parameters(recurse=False), *b.named_buffers(recurse=False)]:
                tensor.copy_(getattr(a, name))
        theirs.last_layer.weight_g.copy_(ours.last_layer.weight_g)
        theirs.last_layer.weight_v.copy_(ours.last_layer.weight_v)


def build_lightly(hp: dict[str, Any], student_init: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(student, teacher, loss) as in lightly's DINO example, the student starting from ``student_init``
    (our student: ``.backbone`` and ``.head``)."""
    from lightly.loss import DINOLoss
    from lightly.models.modules import DINOProjectionHead
    from lightly.models.utils import deactivate_requires_grad

    check_lightly_can(hp)
    backbone = create_model(hp["backbone"], drop_path_rate=hp["drop_path_rate"], **hp["backbone_kwargs"])
    backbone.load_state_dict(student_init.backbone.state_dict())

    def make_head() -> nn.Module:
        return DINOProjectionHead(
            backbone.embed_dim,
            hp["head_hidden_dim"],
            hp["head_bottleneck_dim"],
            hp["out_dim"],
            batch_norm=hp["use_bn_in_head"],
            freeze_last_layer=hp["freeze_last_layer"],
            norm_last_layer=hp["norm_last_layer"],
        )

    head = make_head()
    _copy_head(student_init.head, head)
    student = nn.Sequential()
    student.add_module("backbone", backbone)
    student.add_module("head", head)
    # As in lightly's example: the teacher backbone is a deepcopy, the teacher head a second
    # DINOProjectionHead (a legacy weight_norm module cannot be deep-copied); it is loaded with the student's
    # weights so that the teacher starts equal to the student, as in DINO.
    teacher = nn.Sequential()
    teacher.add_module("backbone", copy.deepcopy(backbone))
    teacher.add_module("head", make_head())
    teacher.head.load_state_dict(head.state_dict())
    deactivate_requires_grad(teacher)
    for m in teacher.modules():  # the teacher is an average: no stochastic depth (as in DINO)
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    loss = DINOLoss(
        output_dim=hp["out_dim"],
        warmup_teacher_temp=hp["warmup_teacher_temp"],
        teacher_temp=hp["teacher_temp"],
        warmup_teacher_temp_epochs=hp["warmup_teacher_temp_epochs"],
        student_temp=hp["student_temp"],
        center_momentum=hp["center_momentum"],
    )
    return student, teacher, loss


def lightly_hparams(student: nn.Module, loss: nn.Module, transform, hp: dict[str, Any]) -> dict[str, Any]:
    """The settings read back from the lightly objects, in the keys of :func:`ours_hparams`."""
    head = student.head
    linears = [m for m in head.layers.modules() if isinstance(m, nn.Linear)]
    g0, g1, loc = transform.transforms[0], transform.transforms[1], transform.transforms[2]

    def parts(view):
        ops = view.transform.transforms
        find = {type(o).__name__: o for o in ops}
        crop, jitter = find["RandomResizedCrop"], find["RandomApply"]
        cj = jitter.transforms[0]
        return crop, jitter, cj, find

    crop0, jit0, cj0, f0 = parts(g0)
    crop_l, _, cj_l, fl = parts(loc)
    _, _, cj1, f1 = parts(g1)

    def strengths(cj) -> tuple[float, ...]:
        # torchvision stores (1 - s, 1 + s) for brightness/contrast/saturation, (-h, h) for hue, None for 0.
        values = [cj.brightness, cj.contrast, cj.saturation]
        return (*(0.0 if v is None else v[1] - 1 for v in values), 0.0 if cj.hue is None else cj.hue[1])

    if not (strengths(cj0) == strengths(cj1) == strengths(cj_l)):
        raise AssertionError(f"lightly views got different jitters: {strengths(cj0)}, {strengths(cj1)}")
    norm = f0["Normalize"]
    temps = loss.teacher_temp_schedule
    out = {
        "backbone": hp["backbone"],
        "backbone_kwargs": hp["backbone_kwargs"],
        "drop_path_rate": max(float(getattr(m, "drop_prob", 0.0)) for m in student.backbone.modules()),
        "out_dim": loss.center.shape[-1],
        "head_hidden_dim": linears[0].out_features,
        "head_bottleneck_dim": linears[-1].out_features,
        "head_nlayers": len(linears),
        "use_bn_in_head": any(isinstance(m, nn.BatchNorm1d) for m in head.modules()),
        "norm_last_layer": not head.last_layer.weight_g.requires_grad,
        "warmup_teacher_temp": round(float(temps[0]), 6) if len(temps) else hp["warmup_teacher_temp"],
        "teacher_temp": loss.teacher_temp,
        "warmup_teacher_temp_epochs": loss.warmup_teacher_temp_epochs,
        "student_temp": loss.student_temp,
        "center_momentum": loss.center_momentum,
        "centering": "ema",  # lightly's only mode ("mean")
        "koleo_weight": 0.0,  # lightly's DINO example has no KoLeo term
        "freeze_last_layer": head.freeze_last_layer,
        "global_crops_size": crop0.size[0],
        "global_crops_scale": tuple(crop0.scale),
        "local_crops_number": len(transform.transforms) - 2,
        "local_crops_size": crop_l.size[0],
        "local_crops_scale": tuple(crop_l.scale),
        "global_blur_probs": (f0["GaussianBlur"].prob, f1["GaussianBlur"].prob),
        "local_blur_prob": fl["GaussianBlur"].prob,
        "global_solarize_probs": (f0["RandomSolarization"].prob, f1["RandomSolarization"].prob),
        "local_solarize_prob": fl["RandomSolarization"].prob,
        "blur_radius": tuple(f0["GaussianBlur"].sigmas),
        "flip_prob": f0["RandomHorizontalFlip"].p,
        "color_jitter": tuple(round(float(v), 6) for v in strengths(cj0)),
        "color_jitter_prob": jit0.p,
        "grayscale_prob": f0["RandomGrayscale"].p,
        "mean": tuple(norm.mean),
        "std": tuple(norm.std),
    }
    # The loop settings are the shared ones (one dict feeds both loops); everything above is read back.
    for key in ("momentum_teacher", "lr", "min_lr", "warmup_epochs", "weight_decay", "weight_decay_end"):
        out[key] = hp[key]
    for key in ("clip_grad", "batch_size", "epochs", "steps_per_epoch", "peak_lr"):
        out[key] = hp[key]
    return out


def train_lightly(
    hp: dict[str, Any], student: nn.Module, teacher: nn.Module, loss_fn: nn.Module, dataset: ImageDataset,
    workers: int, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """lightly's DINO loop for ``hp['epochs'] x hp['steps_per_epoch']`` steps; returns losses and timing."""
    from lightly.models.utils import update_momentum
    from lightly.utils.scheduler import cosine_schedule as lightly_cosine

    epochs, iters = hp["epochs"], hp["steps_per_epoch"]
    total = epochs * iters
    lr_s = cosine_schedule(hp["peak_lr"], hp["min_lr"], epochs, iters, warmup_epochs=hp["warmup_epochs"])
    wd_s = cosine_schedule(hp["weight_decay"], hp["weight_decay_end"], epochs, iters)
    ours_m = cosine_schedule(hp["momentum_teacher"], 1.0, epochs, iters)
    opt = torch.optim.AdamW(get_params_groups(student), lr=0.0)
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset, batch_size=hp["batch_size"], shuffle=True, drop_last=True, num_workers=workers,
        collate_fn=collate_train, generator=g, persistent_workers=workers > 0,
    )  # fmt: skip
    if len(loader) < iters:
        raise ValueError(f"{len(loader)} batches per epoch, fewer than steps_per_epoch={iters}")
    student.train()
    teacher.train()
    losses, signals, m_gap, step = [], [], 0.0, 0
    start = time.perf_counter()
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            if i >= iters:
                break
            views = batch[0]
            for k, group in enumerate(opt.param_groups):
                group["lr"] = float(lr_s[step])
                if k == 0:
                    group["weight_decay"] = float(wd_s[step])
            with torch.no_grad():
                teacher_out = [teacher(v) for v in views[:2]]
            student_out = [student(v) for v in views]
            signals.append(_signals(loss_fn, teacher_out, epoch))  # before the loss moves the centre
            loss = loss_fn(teacher_out, student_out, epoch=epoch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"lightly loss is {loss.item()} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if hp["clip_grad"]:
                clip_gradients(student, hp["clip_grad"])
            student.head.cancel_last_layer_gradients(current_epoch=epoch)
            opt.step()
            m = lightly_cosine(step, total, hp["momentum_teacher"], 1.0)
            m_gap = max(m_gap, abs(m - float(ours_m[step])))
            update_momentum(student, teacher, m=m)
            losses.append(float(loss.detach()))
            step += 1
    minutes = (time.perf_counter() - start) / 60
    return {"losses": losses, "signals": signals, "steps": step, "minutes": minutes, "momentum_gap": m_gap}


@torch.no_grad()
def _signals(loss_fn: nn.Module, teacher_out: list[torch.Tensor], epoch: int) -> tuple[float, float]:
    """(mean teacher entropy, KL of the mean teacher distribution to uniform) of lightly's centred, sharpened
    teacher, as our DINOLoss reports them (the collapse signals)."""
    if epoch < loss_fn.warmup_teacher_temp_epochs:
        temp = float(loss_fn.teacher_temp_schedule[epoch])
    else:
        temp = loss_fn.teacher_temp
    logits = torch.cat(teacher_out) - loss_fn.center.reshape(1, -1)
    probs = torch.softmax(logits / temp, dim=-1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum(-1).mean()
    mean = probs.mean(0)
    kl = (mean * torch.log(mean.clamp_min(1e-12))).sum() + math.log(probs.shape[1])
    return float(entropy), float(kl)


def _tail_mean(signals: list[tuple[float, float]]) -> tuple[float, float]:
    """Entropy and KL averaged over the last 10 % of the steps."""
    tail = signals[-max(1, len(signals) // 10) :]
    return sum(e for e, _ in tail) / len(tail), sum(k for _, k in tail) / len(tail)


# ---------------------------------------------------------------------------------------------- ours side
def train_ours(model: DINO, dm: DINODataModule, epochs: int, limit_batches: int | None) -> dict[str, Any]:
    losses: list[float] = []
    signals: list[tuple[float, float]] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get("train/loss_step")
            if value is not None:
                losses.append(float(value))
            if pl_module.last_collapse_signals is not None:
                signals.append(pl_module.last_collapse_signals)

    trainer = L.Trainer(
        max_epochs=epochs, limit_train_batches=limit_batches, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Losses()],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, dm)
    minutes = (time.perf_counter() - start) / 60
    return {"losses": losses, "signals": signals, "steps": trainer.global_step, "minutes": minutes}


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def features(backbone: nn.Module, dataset: ImageDataset) -> tuple[torch.Tensor, torch.Tensor]:
    was = backbone.training
    backbone.eval()
    feats, labels = [], []
    try:
        for batch in DataLoader(dataset, batch_size=128, collate_fn=collate_skip_none):
            if batch is not None:
                feats.append(backbone(batch[0]).float())
                labels.append(torch.as_tensor(batch[1]).long())
    finally:
        backbone.train(was)
    return torch.cat(feats), torch.cat(labels)


def knn_top1(backbone: nn.Module, dm: DINODataModule) -> float:
    """DINO's weighted k-NN top-1 (%) of ``backbone`` on the datamodule's (bank, held-out queries)."""
    bank, queries = dm.knn_datasets()
    bf, by = features(backbone, bank)
    qf, qy = features(backbone, queries)
    scores = weighted_knn(bf, by, qf, ks=(K,), temperature=T)[K]
    return 100.0 * float((scores.argmax(1) == qy).float().mean())


# -------------------------------------------------------------------------------------------------- main
def prepare(args: argparse.Namespace) -> tuple[dict, dict, int]:
    model_kw, data_kw, epochs = _learning().settings(args)
    return model_kw, data_kw, epochs


def run(args: argparse.Namespace) -> dict[str, Any]:
    install_filters()  # the same quiet console as `ssl-xcit fit`
    torch.set_num_threads(args.threads)
    model_kw, data_kw, epochs = prepare(args)
    dm = DINODataModule(**data_kw)
    dm.setup("fit")
    n_batches = len(dm.train_dataset) // dm.hparams.batch_size
    iters = min(args.limit_batches or n_batches, n_batches)

    L.seed_everything(args.seed, verbose=False)
    ours = DINO(**model_kw)
    hp = ours_hparams(ours, dm, epochs, iters)
    init = copy.deepcopy(ours.student)
    results: dict[str, Any] = {"hparams": hp, "rows": []}
    results["rows"].append(
        {"run": "random init", "steps": 0, "minutes": 0.0, "knn": knn_top1(init.backbone, dm)}
    )
    results["rows"].append(
        {"run": "raw pixels", "steps": 0, "minutes": 0.0, "knn": knn_top1(nn.Flatten(), dm)}
    )

    # Ours: the recipe's setting, then (if it differs) the centring lightly has.
    variants = [("ours", {})]
    lightly_like = {"centering": "ema", "koleo_weight": 0.0}
    if any(hp[k] != v for k, v in lightly_like.items()):
        variants.append(("ours as lightly (ema, no KoLeo)", lightly_like))
    for name, override in variants:
        L.seed_everything(args.seed, verbose=False)
        model = DINO(**{**model_kw, **override})
        model.student.load_state_dict(init.state_dict())
        model.teacher.load_state_dict(init.state_dict())
        out = train_ours(model, dm, epochs, args.limit_batches)
        results["rows"].append(
            {"run": name, "centering": model.hparams.centering, "steps": out["steps"], "minutes": out["minutes"],
             "knn": knn_top1(model.teacher.backbone, dm), "loss_first": out["losses"][0],
             "loss_last": out["losses"][-1], "moved": _moved(init, model.student), "signals": _tail_mean(out["signals"])}
        )  # fmt: skip

    # lightly: same start weights, files, crops, batch, steps and settings.
    L.seed_everything(args.seed, verbose=False)
    student, teacher, loss_fn = build_lightly(hp, init)
    transform = lightly_transform(hp)
    results["lightly_hparams"] = lightly_hparams(student, loss_fn, transform, hp)
    dataset = ImageDataset(dm.train_dataset.samples, dm.train_dataset.classes, transform)
    out = train_lightly(hp, student, teacher, loss_fn, dataset, args.workers, args.seed)
    results["momentum_gap"] = out["momentum_gap"]
    results["rows"].append(
        {"run": "lightly", "centering": "ema (mean)", "steps": out["steps"], "minutes": out["minutes"],
         "knn": knn_top1(teacher.backbone, dm), "loss_first": out["losses"][0], "loss_last": out["losses"][-1],
         "moved": _moved(init, student), "signals": _tail_mean(out["signals"])}
    )  # fmt: skip
    report(args, results)
    return results


def _moved(before: nn.Module, after: nn.Module) -> float:
    """Largest absolute change of any backbone weight."""
    pairs = zip(before.backbone.parameters(), after.backbone.parameters(), strict=True)
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    hp = results["hparams"]
    print(
        f"\nSettings ({args.recipe}, data {args.data}): {hp['epochs']} epochs x {hp['steps_per_epoch']} steps, "
        f"batch {hp['batch_size']}, {hp['backbone']} {hp['backbone_kwargs'] or ''}, crops 2x{hp['global_crops_size']}"
        f"{list(hp['global_crops_scale'])} + {hp['local_crops_number']}x{hp['local_crops_size']}"
        f"{list(hp['local_crops_scale'])}, out_dim {hp['out_dim']}, BN head {hp['use_bn_in_head']}, "
        f"T_t {hp['warmup_teacher_temp']}->{hp['teacher_temp']} over {hp['warmup_teacher_temp_epochs']} ep, "
        f"m {hp['momentum_teacher']}, peak lr {hp['peak_lr']:.3g}, centering {hp['centering']}, "
        f"threads {torch.get_num_threads()}"
    )
    same = {k for k in hp if results["lightly_hparams"].get(k) == hp[k]}
    diff = sorted(set(hp) - same)
    print(f"hyper-parameters equal on both sides: {len(same)}/{len(hp)}; different: {diff or 'none'}")
    print(f"teacher momentum: lightly cosine_schedule vs ours, max |diff| {results['momentum_gap']:.2e}")
    print(
        f"H, KL end: teacher entropy and KL to uniform (nats, last 10 % of steps); ln(out_dim) = "
        f"{math.log(hp['out_dim']):.2f} with KL ~ 0 is uniform collapse, H ~ 0 is one-prototype collapse"
    )
    print(
        f"\n| run | centering | steps | train min | k-NN top-1 (k {K}, T {T}) | loss first -> last | H, KL end |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}" if "loss_first" in r else "-"
        sig = "{:.2f}, {:.3f}".format(*r["signals"]) if "signals" in r else "-"
        print(
            f"| {r['run']} | {r.get('centering', '-')} | {r['steps']} | {r['minutes']:.1f} | {r['knn']:.2f} | {loss} | {sig} |"
        )
    by = {r["run"]: r["knn"] for r in results["rows"]}
    for name in [n for n in by if n.startswith("ours")]:
        print(f"{name} - lightly: {by[name] - by['lightly']:+.2f} points")


if __name__ == "__main__":
    run(parse_args())
