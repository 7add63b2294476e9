"""The trainer settings of a matrix row's runs: its precision (the CPU GradScaler of ``16-mixed``) and its
strategy (``matrix_options.FSDP2_AXES``: what an FSDP2 row's runs do differently from DDP's).

An FSDP2 row trains under ``--trainer.strategy fsdp2`` (sharded checkpoints) or ``fsdp2_whole`` (one file) on
2 processes and on 1 (a 1-rank mesh); its 1-process references add ``ddp``, the same run under Lightning's
default strategy, which the DDP rows prove equal to 2-process DDP. The state a run records is gathered whole
(``whole_state_dict``; every rank calls it), so the checks compare whole tensors as for DDP.
"""

from __future__ import annotations

from typing import Any

import torch
from matrix_options import expected_refusal, strategy


def trainer_strategy(row: dict[str, str], world_size: int) -> str:
    """The ``Trainer(strategy=...)`` of a run of ``row`` on ``world_size`` processes."""
    name = strategy(row)
    if name == "ddp":
        return "ddp" if world_size > 1 else "auto"
    import ssl_xcit.trainer.fsdp  # noqa: F401 (registers the names)

    return name


def precision_args(precision: str, accelerator: str) -> dict[str, Any]:
    """``16-mixed`` on the CPU needs its GradScaler given: Lightning otherwise runs bf16 with no scaler."""
    if precision == "16-mixed":
        from lightning.pytorch.plugins import MixedPrecision

        scaler = torch.amp.GradScaler(accelerator, init_scale=scaler_init())
        return {"plugins": [MixedPrecision("16-mixed", accelerator, scaler)]}
    return {"precision": precision}


def scaler_init() -> float:
    """The CPU GradScaler's first scale (``matrix_worker.SCALER_INIT`` says why)."""
    from matrix_worker import SCALER_INIT

    return SCALER_INIT


def module_state(model: Any) -> dict[str, torch.Tensor]:
    """The module's state dict, float32 copies of whole tensors (FSDP2's shards gathered)."""
    from ssl_xcit.trainer.fsdp import whole_state_dict

    return {k: v.float() for k, v in whole_state_dict(model).items()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Each parameter's optimiser state, in parameter order, as whole float32 tensors."""
    from torch.distributed.tensor import DTensor

    def whole(v: torch.Tensor) -> torch.Tensor:
        return (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone()

    states = (optimizer.state[p] for g in optimizer.param_groups for p in g["params"])
    return [{k: whole(v) for k, v in s.items() if isinstance(v, torch.Tensor)} for s in states]


def refusal(row: dict[str, str], err: BaseException) -> dict[str, str] | None:
    """``{"refused": message}`` when ``err`` is the refusal ``row`` expects, else None (a failure)."""
    expected = expected_refusal(row)
    message = str(err)
    if expected is not None and expected in message:
        return {"refused": f"{type(err).__name__}: {message}"}
    return None
