"""FSDP2 for DINO: ``--trainer.strategy fsdp2`` shards every network of a run over the data-parallel ranks.

``FSDP2Strategy`` is Lightning's ``ModelParallelStrategy`` with the whole world as the data-parallel mesh
dimension (no tensor parallelism) and DINO's checkpoint needs; :func:`shard_module` is what the module's
``configure_model`` calls. As DINOv3 does, each transformer block is one ``fully_shard`` unit, the rest of a
backbone (stem, positional terms, final norm) is its root unit, and each head is sharded on its own. The EMA
teacher, the Gram teacher and a distillation teacher are sharded exactly like the student, so every rank
holds the same slice of a parameter in all of them and the EMA update is local (:func:`local_parameters`).

With ``bf16-mixed`` the units compute in bf16, reduce gradients in float32 and keep float32 master weights
(DINOv3's ``MixedPrecisionPolicy``); BatchNorms (XCiT's, which DINOv3's ViTs lack) keep float32 weights.
``16-mixed`` is refused (:func:`refuse_scaled_precision`); on a CPU, Lightning turns a ``16-mixed`` flag into
``bf16-mixed`` before any strategy sees it, as for DDP.

Not supported: ``compile`` (DINOv3 compiles per block; untested here) and tensor parallelism.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn
from torch.distributed.tensor import DTensor

from ssl_xcit.errors import UserError
from ssl_xcit.models.activation_checkpointing import blocks

STRATEGY_NAME = "fsdp2"
WHOLE_NAME = "fsdp2_whole"

# A backbone's methods that read its root unit's parameters besides ``forward`` (ours and timm's); FSDP2
# gathers them only around the methods it knows of.
FORWARD_METHODS = (
    "forward_features",
    "forward_head",
    "forward_cls_patches",
    "forward_patch_tokens",
    "forward_intermediates",
    "get_intermediate_layers",
    "get_intermediate_cls",
    "get_attention_maps",
)


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` as pure FSDP2: one data-parallel mesh dimension over every process (the
    parent's default puts the processes of a node on the tensor-parallel dimension). It runs on CPU with
    gloo as on CUDA with NCCL: the parent picks the backend from the device and builds the mesh on it.

    Args:
        save_distributed_checkpoint: ``True`` writes a folder of per-rank shards (torch distributed
            checkpoint); ``False`` gathers the whole state on rank 0 into one file.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, save_distributed_checkpoint: bool = True, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def setup_environment(self) -> None:
        refuse_scaled_precision(self.precision_plugin)
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        super().setup_environment()

    @property
    def data_parallel_mesh(self) -> Any:
        """The 1-D mesh the networks are sharded over."""
        return self.device_mesh["data_parallel"]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint is written whole or not at all: into ``<path>.partial`` by every rank, then
        renamed over ``<path>`` by rank 0 (the old folder is removed only once the new one is in place). A
        one-file checkpoint goes through the checkpoint IO (atomic: ``ssl_xcit.dino.checkpointing``)."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(path.name + ".partial")
        if self.global_rank == 0 and partial.exists():  # left by a run killed mid-write
            shutil.rmtree(partial)
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.global_rank == 0:
            _replace(partial, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder loads as Lightning loads it. A one-file checkpoint (``fsdp2_whole``, a gathered
        folder) goes through the module's own ``load_state_dict``, each whole tensor cut to this rank's shard:
        Lightning's own path sets parameters and buffers submodule by submodule, so it asked for a
        distillation teacher the checkpoint leaves out (``Distill.state_dict``) and never restored a
        module's extra state (the Gram teacher's taken/refresh record)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            return self._load_sharded(path, weights_only)
        from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        module = self.lightning_module
        strict = module.strict_loading
        load_whole_state(module, checkpoint.pop("state_dict"), strict=strict)
        # The optimiser's state is not strict: a parameter that never had a gradient has none (the head's last
        # layer in its freeze epoch, the backbone in init_from's warm-up), and starts fresh on resume, as torch's
        # own Optimizer.load_state_dict does; the weights above load strictly.
        options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=False)
        for index, optimizer in enumerate(self.optimizers):
            state = _rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][index], self.model)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)
        return checkpoint

    def _load_sharded(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's load of a sharded folder (``ModelParallelStrategy.load_checkpoint``), with each
        optimiser given state for exactly the parameters the folder holds state for. Lightning reads the
        folder for the keys of ``get_optimizer_state_dict``, which first gives a fresh optimiser state for every
        trainable parameter (a zero-gradient step at lr 0), and then loads strictly: a parameter that had no
        state when the folder was written (the head's last layer in DINO's freeze epoch, the backbone in
        init_from's warm-up: no gradient yet) was a missing key, and the resume failed. Such a parameter starts
        fresh, as torch's own ``Optimizer.load_state_dict`` leaves it; the weights load as strictly as before."""
        from lightning.fabric.strategies.model_parallel import (
            _METADATA_FILENAME,
            _distributed_checkpoint_load,
        )
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            _init_optim_state,  # what get_optimizer_state_dict runs on an optimiser without state
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        state = {"state_dict": get_model_state_dict(module)}
        _distributed_checkpoint_load(state, path)
        module.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        saved = {key.split(".state.", 1)[1].rsplit(".", 1)[0] for key in
                 FileSystemReader(str(path)).read_metadata().state_dict_metadata if ".state." in key}  # fmt: skip
        names = {id(p): n for n, p in module.named_parameters()}
        for index, optimizer in enumerate(self.optimizers):
            _init_optim_state(optimizer)
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if names.get(id(param)) not in saved:
                        optimizer.state.pop(param, None)
            key = f"optimizer_{index}"
            optim_state = {key: get_optimizer_state_dict(module, optimizer)}
            _distributed_checkpoint_load(optim_state, path)
            options = StateDictOptions(cpu_offload=True, strict=False)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key], options=options)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # A network that ran a forward with no backward since (the EMA teacher, a validation pass) keeps its
        # root unit gathered; the state dict must see the shards.
        reshard(self.lightning_module)
        return super().lightning_module_state_dict()


def refuse_scaled_precision(plugin: Any) -> None:
    """Refuse ``16-mixed`` before any process group or model exists. Lightning refuses it for a
    ``ModelParallelStrategy`` instance only, not for a registered name: its GradScaler would reach here (on
    CUDA, or given as a plugin) and each rank would decide from its own shards whether a step overflowed."""
    precision = str(getattr(plugin, "precision", ""))
    if precision.startswith("16") or getattr(plugin, "scaler", None) is not None:
        raise UserError(
            f"{precision} is not supported under --trainer.strategy fsdp2 (a GradScaler's overflow check would "
            "see only each rank's shards); use --trainer.precision bf16-mixed (DINOv3's) or 32-true"
        )


def _replace(new: Path, path: Path) -> None:
    """Put the folder ``new`` at ``path``; an old folder there is moved aside first and removed last, so a
    kill at any point leaves a whole checkpoint (``path``, or ``path.old`` for an instant)."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.is_dir():
        path.rename(old)
    elif path.exists():
        path.unlink()
    new.rename(path)
    if old.exists():
        shutil.rmtree(old)


def register_strategy() -> None:
    """``--trainer.strategy fsdp2`` (sharded checkpoints) and ``fsdp2_whole`` (one-file checkpoints);
    idempotent: importing this module registers them."""
    if STRATEGY_NAME not in StrategyRegistry:
        StrategyRegistry.register(
            STRATEGY_NAME, FSDP2Strategy, description="FSDP2 (fully_shard per block), sharded checkpoints"
        )
    if WHOLE_NAME not in StrategyRegistry:
        StrategyRegistry.register(
            WHOLE_NAME,
            FSDP2Strategy,
            description="FSDP2 (fully_shard per block), one-file checkpoints",
            save_distributed_checkpoint=False,
        )


register_strategy()


def is_fsdp2(trainer: Any) -> bool:
    """Whether ``trainer`` (or None, or a stand-in without a strategy) trains under :class:`FSDP2Strategy`."""
    return isinstance(getattr(trainer, "strategy", None), FSDP2Strategy)


def _policy(precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":  # DINOv3: bf16 compute, float32 gradient reduction and master weights
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_backbone(backbone: nn.Module, mesh: Any, policy: Any) -> None:
    """One unit per block, then the backbone's own unit (stem, positional terms, norms) around ``forward``
    and every method in ``FORWARD_METHODS``. A backbone with no block list is one unit as a whole. Under a
    reduced-precision policy each BatchNorm is a float32 unit of its own first (as autocast leaves it: its
    float32 running statistics and bf16 weights cannot meet in one kernel)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if policy.param_dtype is not None:  # its running statistics stay float32: so must its weights
        for norm in [m for m in backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
            fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=policy.reduce_dtype))
    for block in blocks(backbone):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(backbone, mesh=mesh, mp_policy=policy)
    for method in FORWARD_METHODS:
        if callable(getattr(backbone, method, None)):
            register_fsdp_forward_method(backbone, method)


def _backbones(module: nn.Module) -> list[nn.Module]:
    """The backbones of a DINO module: student's, teacher's (EMA or frozen distillation teacher), Gram's."""
    nets = [getattr(module, name, None) for name in ("student", "teacher", "gram_teacher")]
    return [
        net.backbone
        for net in nets
        if net is not None and isinstance(getattr(net, "backbone", None), nn.Module)
    ]


def shard_module(module: nn.Module, mesh: Any, precision: str) -> None:
    """Shard every network of a DINO module over ``mesh`` (``configure_model`` under ``fsdp2``).

    The backbones go per block (:func:`shard_backbone`); every other module that holds parameters directly
    (the heads' linear layers, a distillation projection) becomes a unit of its own, so it is gathered by
    its own ``forward`` however the step calls it. Student and teacher have the same structure, hence the
    same units and the same shards on every rank."""
    from torch.distributed.fsdp import fully_shard

    if getattr(module.hparams, "compile", False):
        raise UserError(
            "compile is not supported under --trainer.strategy fsdp2 yet; set --model.compile false"
        )
    policy = _policy(str(module.trainer.precision))
    for backbone in _backbones(module):
        shard_backbone(backbone, mesh, policy)
    for sub in reversed(list(module.modules())):  # innermost first: each module its own unit
        own = [p for p in sub.parameters(recurse=False) if not isinstance(p, DTensor)]
        if own:
            fully_shard(sub, mesh=mesh, mp_policy=policy)
    left = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
    if left:  # cannot happen with the rule above; a silent replica would train without gradient reduction
        raise RuntimeError(f"parameters left unsharded under fsdp2: {left[:5]}")


def reshard(module: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit in ``module`` (a no-op for unsharded ones). A root
    unit stays gathered after a forward that no backward follows (the teacher's)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def local_parameters(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters as this rank holds them: the local shards under FSDP2 (after resharding),
    the tensors themselves otherwise. Networks sharded alike give lists of equal shapes, element by element."""
    reshard(module)
    return [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]


def local_tensors(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each tensor's local shard (DTensor) or the tensor itself; in place edits reach the DTensor."""
    for t in tensors:
        yield t.to_local() if isinstance(t, DTensor) else t


def tensor_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each whole tensor, stacked. Sharded tensors (DTensors over one mesh) sum their local
    squared norms over the mesh in one all-reduce; plain tensors take ``torch._foreach_norm``."""
    local = list(local_tensors(tensors))
    norms = torch.stack(torch._foreach_norm(local, 2.0))
    sharded = [isinstance(t, DTensor) for t in tensors]
    if not any(sharded):
        return norms
    if not all(sharded) or any(t.placements != tensors[0].placements for t in tensors):
        raise RuntimeError("per-tensor norms need all tensors sharded alike")
    squares = norms.float().square()
    dist.all_reduce(squares, group=tensors[0].device_mesh.get_group())
    return squares.sqrt().to(norms.dtype)


def load_whole_state(module: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """``module.load_state_dict(state)`` for a whole (unsharded) ``state`` that every rank holds. Under FSDP2
    each tensor whose place in the module is sharded is first cut to this rank's slice locally (no
    communication); the module's own ``load_state_dict`` then runs, with its overrides and every submodule's
    extra state."""
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        module.load_state_dict(state, strict=strict)
        return
    from torch.distributed.tensor import distribute_tensor

    reshard(module)
    current = module.state_dict()
    state = dict(state)
    for key, value in state.items():
        placed = current.get(key)
        if isinstance(placed, DTensor) and not isinstance(value, DTensor):
            value = value.to(device=placed.device, dtype=placed.dtype)
            state[key] = distribute_tensor(value, placed.device_mesh, placed.placements, src_data_rank=None)
    module.load_state_dict(state, strict=strict)


def whole_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with whole tensors: FSDP2's shards gathered (every rank must call it), plain
    tensors as they are; detached copies."""
    reshard(module)
    state = module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
