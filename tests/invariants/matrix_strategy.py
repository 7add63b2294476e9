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
from matrix_options import expected_refusal, setting, strategy


def trainer_strategy(row: dict[str, str], world_size: int) -> Any:
    """The ``Trainer(strategy=...)`` of a run of ``row`` on ``world_size`` processes: a registered name, or
    under ``reshard: kept`` the FSDP2 strategy with ``reshard_after_forward=False``."""
    name = strategy(row)
    if name == "ddp":
        return "ddp" if world_size > 1 else "auto"
    from ssl_xcit.parallel.fsdp import WHOLE_NAME, FSDP2Strategy  # registers the names

    if setting(row, "reshard") == "kept":
        return FSDP2Strategy(save_distributed_checkpoint=name != WHOLE_NAME, reshard_after_forward=False)
    return name


def precision_args(precision: str, accelerator: str, scaler: str = "low") -> dict[str, Any]:
    """``16-mixed`` on the CPU needs its GradScaler given: Lightning otherwise runs bf16 with no scaler.
    ``scaler`` names its settings (``matrix_worker.SCALERS`` says why)."""
    if precision == "16-mixed":
        from lightning.pytorch.plugins import MixedPrecision
        from matrix_worker import SCALERS

        grad_scaler = torch.amp.GradScaler(accelerator, **SCALERS[scaler])
        return {"plugins": [MixedPrecision("16-mixed", accelerator, grad_scaler)]}
    return {"precision": precision}


def module_state(model: Any) -> dict[str, torch.Tensor]:
    """The module's state dict, float32 copies of whole tensors (FSDP2's shards gathered)."""
    from ssl_xcit.parallel.fsdp import whole_state_dict

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


def local_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What this rank holds itself, no gather: each state tensor and each parameter's optimiser state as float32
    copies of the local shard (FSDP2) or the tensor, with whether it is sharded. The ``ranks equal`` column
    compares the sharded ones with the same slices of the 1-process run, the others between the ranks: a
    gathered whole tensor is the same all-gathered copy on every rank by construction, and proves nothing."""
    from torch.distributed.tensor import DTensor

    from ssl_xcit.parallel.fsdp import reshard

    def local(v: torch.Tensor) -> tuple[torch.Tensor, bool]:
        sharded = isinstance(v, DTensor)
        return (v.to_local() if sharded else v).detach().float().clone(), sharded

    reshard(model)
    states = (optimizer.state[p] for g in optimizer.param_groups for p in g["params"])
    return {
        "state": {k: local(v) for k, v in model.state_dict().items()},
        "optimizer": [{k: local(v) for k, v in s.items() if isinstance(v, torch.Tensor)} for s in states],
    }
