"""Collapse guard: notice when DINO's teacher has collapsed, say so once with the numbers and the remedy.

DINO has two failure modes that its loss hides (the loss of a collapsed run is flat and plausible):

- **uniform**: centring wins, every teacher output is the uniform distribution. Per-sample entropy sits at
  ln(K) and the KL of the mean output to uniform at 0; the student learns nothing.
- **one prototype**: sharpening wins, one prototype takes every image. Per-sample entropy goes to 0 and the
  KL of the mean output to uniform to ln(K).

A healthy teacher is confident per sample (entropy well below ln K) and spread over the batch (KL well below
ln K). The guard watches both signals of every training step and reports a mode only once it has held for
``patience`` consecutive steps after ``grace_steps`` (a random-init teacher starts near uniform). The signals
stay on the device; the guard reads the steps gathered so far every ``read_every`` optimiser steps (DINO's
``sync_every_n_steps``) and at each epoch's end, so a collapse is reported (and a run stopped) up to that many
steps late, with the step where it reached its patience.

With iBOT's masked patch term on, the patch targets are watched the same way, as a second term (``ibot``): its
teacher can collapse on its own while the CLS term stays healthy.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from ssl_xcit.errors import UserError

REMEDIES = {
    "uniform": (
        "a sharper teacher (lower warmup_teacher_temp/teacher_temp), centering: sinkhorn_knopp, fewer "
        "prototypes (out_dim), a faster EMA (lower momentum_teacher) or a higher lr"
    ),
    "one_prototype": "a lower lr, a higher teacher temperature, or centering: sinkhorn_knopp",
}


def collapse_mode(
    entropy: float, kl_to_uniform: float, out_dim: int, uniform_fraction: float = 0.95, kl_eps: float = 0.05
) -> Literal["uniform", "one_prototype"] | None:
    """The collapse mode one step's signals show, or None when healthy.

    uniform: entropy >= ``uniform_fraction`` x ln K and KL <= ``kl_eps``; one prototype: entropy <= 5 % of
    ln K and KL >= half of ln K (low entropy alone is a confident, healthy teacher).
    """
    log_k = math.log(out_dim)
    if entropy >= uniform_fraction * log_k and kl_to_uniform <= kl_eps:
        return "uniform"
    if entropy <= 0.05 * log_k and kl_to_uniform >= 0.5 * log_k:
        return "one_prototype"
    return None


def _gather_rows(trainer: Trainer, rows: torch.Tensor) -> list[list[list[float]]]:
    """Every rank's (steps, signals) rows, in rank order: one all-gather and one host read."""
    if trainer.world_size > 1:
        rows = trainer.strategy.all_gather(rows)
    return rows.reshape(-1, *rows.shape[-2:]).cpu().tolist()


def _terms(pl_module: LightningModule) -> list[tuple[str, tuple[Any, Any], int]]:
    """``(name, (entropy, KL), K)`` of each watched term: DINO's, and iBOT's patch term when it runs."""
    terms = []
    # DINO keeps the signals as device tensors (`signal_tensors`); its `last_*` properties read them back.
    tensors = getattr(pl_module, "signal_tensors", None)
    signals = (
        tensors.get("dino") if tensors is not None else getattr(pl_module, "last_collapse_signals", None)
    )
    if signals is not None:
        terms.append(("dino", signals, pl_module.hparams.out_dim))
    patch = (
        tensors.get("ibot")
        if tensors is not None
        else getattr(pl_module, "last_patch_collapse_signals", None)
    )
    if patch is not None:
        terms.append(("ibot", patch, pl_module.ibot_out_dim))
    return terms


class CollapseGuard(Callback):
    """Warn once (or stop the run) when a collapse mode holds for ``patience`` steps.

    Args:
        action: ``warn`` (once per mode), ``stop`` (end training with a message), or ``off``.
        patience: consecutive training steps a mode must hold.
        grace_steps: steps ignored at the start, while a random-init teacher is still near uniform.

    Logs ``collapse/uniform`` and ``collapse/one_prototype`` (1 while the mode holds; ``collapse/ibot_*`` for
    the patch term); ``events`` keeps ``{"mode", "step", "entropy", "kl_to_uniform"}`` per detection (plus
    ``"term": "ibot"`` for the patch term), and ``"ranks"`` (those showing the mode) under DDP. The signals
    are gathered from every rank, so all ranks warn and stop on the same step.
    """

    def __init__(
        self, action: Literal["warn", "stop", "off"] = "warn", patience: int = 50, grace_steps: int = 100
    ) -> None:
        super().__init__()
        if action not in ("warn", "stop", "off"):
            raise UserError(f"collapse guard action must be 'warn', 'stop' or 'off', got {action!r}")
        if patience < 1:
            raise UserError(f"collapse guard patience must be >= 1, got {patience}")
        self.action, self.patience, self.grace_steps = action, patience, grace_steps
        self.events: list[dict[str, Any]] = []
        self._run: dict[str, int] = {}
        self._reported: set[str] = set()
        self._pending: list[tuple[int, torch.Tensor]] = []  # (global step, signals on the device)
        self._held: dict[str, torch.Tensor] = {}

    read_every = 1  # DINO sets its sync_every_n_steps

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        terms = _terms(pl_module)
        if self.action == "off" or not terms or trainer.global_step < self.grace_steps:
            return
        if not getattr(pl_module, "window_closed", True):
            return  # inside an accumulation window: one entry per optimiser step, as DINO's reads count them
        # The signals stay on the device (stacking them queues a kernel); the host reads the steps gathered
        # so far every `read_every` optimiser steps, so the GPU queue is not drained after every step.
        flat = [torch.as_tensor(v, dtype=torch.float32) for _, signals, _ in terms for v in signals]
        self._pending.append((trainer.global_step, torch.stack([v.to(flat[0].device) for v in flat])))
        if len(self._pending) >= self.read_every:
            self._read(trainer, pl_module, terms)
        for key, flag in self._held.items():
            pl_module.log(f"collapse/{key}", flag, on_step=True, on_epoch=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        terms = _terms(pl_module)
        if self._pending and terms:
            self._read(trainer, pl_module, terms)

    def _read(self, trainer: Trainer, pl_module: LightningModule, terms: list) -> None:
        # Every rank sees every rank's signals and takes the same decision: a rank that stopped alone would
        # leave the others waiting in the next collective, and a collapse seen only on rank 3 must still be
        # reported (by rank 0). A mode holds when any rank shows it. Every rank reads at the same batch.
        steps = [step for step, _ in self._pending]
        per_rank = _gather_rows(trainer, torch.stack([row for _, row in self._pending]))
        self._pending = []
        held: dict[str, float] = {}
        for i, step in enumerate(steps):
            for t, (term, _, out_dim) in enumerate(terms):
                signals = [(rows[i][2 * t], rows[i][2 * t + 1]) for rows in per_rank]
                modes = [collapse_mode(entropy, kl, out_dim) for entropy, kl in signals]
                prefix = "" if term == "dino" else f"{term}_"
                for name in ("uniform", "one_prototype"):
                    key = prefix + name
                    self._run[key] = self._run.get(key, 0) + 1 if name in modes else 0
                    held[key] = float(name in modes)
                due = [
                    m
                    for m in ("uniform", "one_prototype")
                    if self._run[prefix + m] >= self.patience
                    and m in modes
                    and prefix + m not in self._reported
                ]
                if due:
                    self._report(trainer, step, term, due[0], modes, signals, out_dim)
        # Logged every batch until the next read: one small copy now, none per step.
        values = torch.tensor(list(held.values()), dtype=torch.float32).to(pl_module.device)
        self._held = dict(zip(held, values.unbind(), strict=True))

    def _report(
        self,
        trainer: Trainer,
        step: int,
        term: str,
        mode: str,
        modes: list[str | None],
        signals: list[tuple[float, float]],
        out_dim: int,
    ) -> None:
        rank = modes.index(mode)
        entropy, kl = signals[rank]
        self._reported.add(mode if term == "dino" else f"{term}_{mode}")
        event: dict[str, Any] = {
            "mode": mode,
            "step": step,
            "entropy": entropy,
            "kl_to_uniform": kl,
        }
        if term != "dino":
            event["term"] = term
        if len(signals) > 1:
            event["ranks"] = [r for r, m in enumerate(modes) if m == mode]
        self.events.append(event)
        where = ""
        if "ranks" in event:
            shown = event["ranks"]
            where = f" on rank{'s' * (len(shown) > 1)} {', '.join(map(str, shown))}"
        what = "DINO teacher" if term == "dino" else "iBOT patch teacher"
        message = (
            f"{what} collapse ({mode.replace('_', ' ')}) for {self.patience} steps at step "
            f"{step}{where}: teacher entropy {entropy:.3f} (ln K = {math.log(out_dim):.3f}), "
            f"KL to uniform {kl:.4f}. Try {REMEDIES[mode]}."
        )
        if self.action == "stop":
            trainer.should_stop = True
            message += " Training stopped (collapse guard action 'stop')."
        rank_zero_warn(message)

    def state_dict(self) -> dict[str, Any]:
        return {"events": self.events, "reported": sorted(self._reported)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict.get("events", []))
        self._reported = set(state_dict.get("reported", []))
