"""FSDP2 for DINO: ``--trainer.strategy fsdp2`` shards every network of a run over the data-parallel ranks.

``FSDP2Strategy`` is Lightning's ``ModelParallelStrategy`` with the whole world as the data-parallel mesh
dimension (no tensor parallelism; HSDP's replicate x shard mesh with ``replicate_degree``) and DINO's checkpoint
needs; :func:`shard_module` is what the module's
``configure_model`` calls. As DINOv3 does, each transformer block is one ``fully_shard`` unit, the rest of a
backbone (stem, positional terms, final norm) is its root unit, and each head is sharded on its own. The EMA
teacher, the Gram teacher, a distillation teacher and distillation's student EMA are sharded exactly like the
student, so every rank holds the same slice of a parameter in all of them and the EMA update is local
(:func:`local_parameters`). The student's blocks are freed after each forward by default, so no rank ever holds
the whole student; ``reshard_after_forward`` false keeps them gathered from their first forward of a step to the end
of its backward (one all-gather per block per step instead of 2: every family's blocks take every crop group in
one call; docs/scaling.md).

With ``bf16-mixed`` the units compute in bf16, reduce gradients in float32 and keep float32 master weights
(DINOv3's ``MixedPrecisionPolicy``); BatchNorms (XCiT's, which DINOv3's ViTs lack) keep float32 weights.
``16-mixed`` is refused (:func:`refuse_scaled_precision`); on a CPU, Lightning turns a ``16-mixed`` flag into
``bf16-mixed`` before any strategy sees it, as for DDP.

Not supported: ``compile`` (DINOv3 compiles per block; untested here) and tensor parallelism.
"""

from __future__ import annotations

import contextlib
import copy
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
from ssl_xcit.models.sharded import tensor_leaves

STRATEGY_NAME = "fsdp2"
WHOLE_NAME = "fsdp2_whole"

# A backbone's methods that read its root unit's parameters besides ``forward`` (ours and timm's); FSDP2
# gathers them only around the methods it knows of.
FORWARD_METHODS = (
    "forward_features",
    "forward_head",
    "forward_cls_patches",
    "forward_cls_patches_list",
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
        reshard_after_forward: what the student's blocks do after their forward (FSDP2's argument):
            ``True`` (default; DINOv3's ``fsdp/ac_compile_parallelize.py`` passes it for every block) frees
            them after each forward, so no rank holds the whole student: the forward over all crop groups and
            its backward gather each block, 2 per block per step; ``False`` (the ``SHARD_GRAD_OP`` its configs name)
            keeps them gathered until the step's backward has ended, one all-gather per block per step, at the
            cost of the whole student's parameters in the compute dtype on every rank; an int ``k`` reshards
            to groups of ``k`` ranks, so backward gathers over ``k`` ranks only.
        replicate_degree: 1 shards over all ranks; ``N`` > 1 is HSDP: the ranks form an ``N`` x ``world / N``
            mesh, each network sharded within a group of ``world / N`` consecutive ranks (a node, with ``N``
            the number of nodes) and replicated across the ``N`` groups (gradients all-reduced across them).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        save_distributed_checkpoint: bool = True,
        reshard_after_forward: bool | int = True,
        replicate_degree: int = 1,
        **kwargs: Any,
    ) -> None:
        if isinstance(reshard_after_forward, str):  # a CLI value that jsonargparse left as text
            text = reshard_after_forward.strip().lower()
            reshard_after_forward = {"true": True, "false": False}.get(text, reshard_after_forward)
            if isinstance(reshard_after_forward, str) and text.isdigit():
                reshard_after_forward = int(text)
        if not isinstance(reshard_after_forward, int):
            raise UserError(
                f"reshard_after_forward must be true, false or a number of ranks, got {reshard_after_forward!r}"
            )
        if (
            isinstance(replicate_degree, bool)
            or not isinstance(replicate_degree, int)
            or replicate_degree < 1
        ):
            raise UserError(
                f"replicate_degree must be a whole number >= 1 (1: FSDP over all ranks; N: HSDP with N replica "
                f"groups, e.g. the number of nodes), got {replicate_degree!r}"
            )
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.replicate_degree = replicate_degree
        self._shard_mesh: Any = None

    def setup_environment(self) -> None:
        refuse_scaled_precision(self.precision_plugin)
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        world = self.num_nodes * self.num_processes
        check_sharding(world, self.replicate_degree, self.reshard_after_forward)
        super().setup_environment()
        if self.replicate_degree > 1:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.replicate_degree, world // self.replicate_degree)
            self._shard_mesh = init_device_mesh(
                self.root_device.type, shape, mesh_dim_names=("replicate", "shard")
            )

    @property
    def data_parallel_mesh(self) -> Any:
        """The mesh the networks are sharded over: 1-D over every rank, or HSDP's 2-D (replicate x shard)
        mesh. Either way it spans every rank: the project's own collectives run over the whole world."""
        if self._shard_mesh is not None:
            return self._shard_mesh
        return self.device_mesh["data_parallel"]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint is written whole or not at all: into ``<path>.partial`` by every rank, then
        renamed over ``<path>`` by rank 0 (the old folder is removed only once the new one is in place). A
        one-file checkpoint is gathered tensor by tensor as rank 0 writes it (:func:`stream_whole_checkpoint`),
        atomically and owner-only as the checkpoint IO writes one (``ssl_xcit.parallel.checkpoint_io``)."""
        if not self._save_distributed_checkpoint:
            from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint

            if storage_options is not None:  # as Lightning's ModelParallelStrategy
                raise TypeError(
                    f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported"
                )
            path = Path(self.broadcast(str(filepath)))
            if path.is_dir() and not _is_sharded_checkpoint(path):
                raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
            # A sharded folder of an fsdp2 run at the path is replaced by the file, as Lightning does.
            if self.global_rank == 0 and path.is_dir():
                shutil.rmtree(path)
            stream_whole_checkpoint(checkpoint, path, self.global_rank == 0, self.broadcast)
            self.barrier()
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
        state = dict(checkpoint.pop("state_dict"))
        adapt = getattr(module, "adapt_state_dict", None)
        if adapt is not None:  # before the strict load: Lightning's on_load_checkpoint comes after it
            adapt(state)
        reshard(module)
        check_state_fits(state, module.state_dict(), strict, path)
        load_whole_state(module, state, strict=strict)
        # The optimiser's state is not strict: a parameter that never had a gradient has none (the head's last
        # layer in its freeze epoch, the backbone in init_from's warm-up), and starts fresh on resume, as torch's
        # own Optimizer.load_state_dict does; the weights above load strictly. Each rank cuts its own slices
        # from the file (no rank reads all of it) and loads them as a sharded optimiser state.
        params = dict(self.model.named_parameters())
        options = StateDictOptions(full_state_dict=False, strict=False)
        for index, optimizer in enumerate(self.optimizers):
            state = _rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][index], self.model)
            state = {**state, "state": {name: _optimizer_slices(entry, params.get(name))
                                        for name, entry in state["state"].items()}}  # fmt: skip
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
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        stored = {
            k.removeprefix("state_dict."): v for k, v in metadata.items() if k.startswith("state_dict.")
        }
        weights = adapted_state(self.lightning_module, stored, path)
        reads, state = sharded_reads(
            weights, get_model_state_dict(module), self.lightning_module.strict_loading, path
        )
        if reads:
            _distributed_checkpoint_load({"state_dict": reads}, path)
        module.load_state_dict(state, strict=self.lightning_module.strict_loading)
        saved = {key.split(".state.", 1)[1].rsplit(".", 1)[0] for key in metadata if ".state." in key}
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
        """The module's state dict: FSDP2's shards (DTensors) on every rank. Lightning's one-file path gathered
        the whole state on rank 0 here; ``save_checkpoint`` gathers it tensor by tensor as it writes."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # A network that ran a forward with no backward since (the EMA teacher, a validation pass) keeps its
        # root unit gathered; the state dict must see the shards.
        reshard(self.lightning_module)
        if self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        # A plain dict, as Lightning's gathered one was: the file's layout stays what it was.
        return dict(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False)))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """An optimiser's state as Lightning's one-file checkpoint keys it (by parameter id, on every rank, so
        every rank walks it in the same order), its tensors left sharded for ``save_checkpoint`` to gather."""
        if self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        options = StateDictOptions(full_state_dict=False)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)
        return FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)


class Stored:
    """Stand-in for a tensor of a sharded checkpoint folder not read yet: its key there and its metadata."""

    def __init__(self, key: str, metadata: Any) -> None:
        self.key, self.metadata = key, metadata

    @property
    def shape(self) -> tuple[int, ...] | None:
        size = getattr(self.metadata, "size", None)
        return tuple(size) if size is not None else None


def adapted_state(module: Any, stored: dict[str, Any], path: Path) -> dict[str, Any]:
    """The folder's weights as ``module`` (a LightningModule) takes them: its ``adapt_state_dict`` hook (Gram
    anchoring switched on or off at resume) run on stand-ins (:class:`Stored`) for the folder's tensors, so an
    entry is either a folder tensor to read (possibly under another key: the Gram teacher from the EMA
    teacher) or a value the hook made."""
    state: dict[str, Any] = {key: Stored(key, meta) for key, meta in stored.items()}
    adapt = getattr(module, "adapt_state_dict", None)
    if adapt is not None:
        adapt(state)
    return state


def check_state_fits(state: dict[str, Any], current: dict[str, Any], strict: bool, path: Any) -> None:
    """A clear error for checkpoint weights that do not fit the module: a key the module lacks or lacks in the
    checkpoint (under ``strict``), or a tensor of another shape (always)."""
    missing = sorted(current.keys() - state.keys())
    unexpected = sorted(state.keys() - current.keys())
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"checkpoint {path} does not fit the model: missing keys {missing[:5]}"
            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            + f", unexpected keys {unexpected[:5]}"
            + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else "")
        )
    for key in sorted(state.keys() & current.keys()):
        value, target = state[key], current[key]
        got = value.shape if isinstance(value, Stored) else getattr(value, "shape", None)
        want = getattr(target, "shape", None)
        if got is not None and want is not None and tuple(got) != tuple(want):
            raise RuntimeError(
                f"checkpoint {path}: {key} has shape {tuple(got)}, the model's is {tuple(want)}"
            )


def sharded_reads(
    state: dict[str, Any], current: dict[str, Any], strict: bool, path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What to read from a sharded folder and what to load then: ``(reads, weights)``, with ``reads`` the
    folder's keys each with the module's (sharded) tensor to read it into, and ``weights`` the state dict for
    the module's ``load_state_dict``, its read entries pointing at those tensors. A folder key read under two
    module keys (the EMA teacher's weights for the Gram teacher too) is read once."""
    check_state_fits(state, current, strict, path)
    reads: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    for key, value in state.items():
        if key not in current:  # not strict: left out, as load_state_dict(strict=False) would
            continue
        if isinstance(value, Stored):
            value = reads.setdefault(value.key, current[key])
        weights[key] = value
    return reads, weights


def _swap_leaves(obj: Any, swap: Any) -> Any:
    """``obj`` with each tensor ``t`` replaced by ``swap(t)`` (containers copied, their types kept)."""
    if isinstance(obj, dict):
        new = copy.copy(obj)
        for key, value in obj.items():
            new[key] = _swap_leaves(value, swap)
        return new
    if isinstance(obj, (list, tuple)):
        items = [_swap_leaves(value, swap) for value in obj]
        if isinstance(obj, list):
            return type(obj)(items) if type(obj) is not list else items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, torch.Tensor):
        return swap(obj)
    return obj


def _layout(handle: Any, checkpoint: dict[str, Any]) -> list[tuple[int, torch.Tensor]]:
    """Write ``checkpoint``'s ``torch.save`` layout into ``handle`` with room for every storage's bytes, the
    sharded tensors (DTensors) as shapes only (no memory); returns, in ``tensor_leaves`` order, the byte offset of
    each tensor's storage and the tensor laid out (a CPU tensor; a placeholder for a DTensor). ``torch.load``
    reads the file once the bytes are in place."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def placeholder(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            with mode:
                return torch.empty(tensor.shape, dtype=tensor.dtype)
        return tensor.detach().cpu()  # as Lightning's cpu_offload: a CUDA buffer is written as a CPU tensor

    skeleton = _swap_leaves(checkpoint, placeholder)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, handle)
    handle.flush()
    handle.seek(0)
    placed = torch.load(handle, map_location="meta", weights_only=False)  # our own file: where each goes
    offsets = [meta.untyped_storage()._checkpoint_offset for meta in tensor_leaves(placed)]
    return list(zip(offsets, tensor_leaves(skeleton), strict=True))


def _write(handle: Any, offset: int, data: torch.Tensor) -> None:
    """Write the bytes of the contiguous tensor ``data`` at ``offset``."""
    handle.seek(offset)
    handle.write(memoryview(data.detach().reshape(-1).view(torch.uint8).cpu().numpy()))


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s whole storage as bytes: what ``torch.save`` writes for a tensor, a view's included."""
    storage = tensor.detach().untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def stream_whole_checkpoint(checkpoint: dict[str, Any], path: Path, writer: bool, broadcast: Any) -> None:
    """Write ``checkpoint`` (its weights and optimiser states FSDP2's shards, the rest whole) as one
    ``torch.save`` file at ``path``, atomically, gathering one tensor at a time: ``writer`` (rank 0) lays the
    file out first (:func:`_layout`), then every rank takes part in each tensor's all-gather in the same order
    and the writer puts its bytes in place. Rank 0 never holds more than one gathered tensor beyond what it
    already held; every rank must call it. ``broadcast``: the strategy's, so all ranks stop if the layout
    failed."""
    from ssl_xcit.utils.io import atomic_write, owner_only

    leaves = list(tensor_leaves(checkpoint))
    with atomic_write(path, "w+b", private=owner_only()) if writer else contextlib.nullcontext() as handle:
        laid, error = [], None
        if writer:
            try:
                laid = _layout(handle, checkpoint)
                if len(laid) != len(leaves):
                    error = f"the layout holds {len(laid)} tensors, the checkpoint {len(leaves)}"
            except Exception as exc:  # the other ranks would wait in the gathers below
                error = f"{type(exc).__name__}: {exc}"
        error = broadcast(error)
        if error is not None:
            raise RuntimeError(f"writing the one-file checkpoint {path} failed: {error}")
        written: set[int] = set()
        for index, tensor in enumerate(leaves):
            if isinstance(tensor, DTensor):  # laid out as a storage of its own, of its shape
                whole = tensor.full_tensor()  # a collective: every rank, in the same order
                if writer:
                    _write(handle, laid[index][0], whole.contiguous())
                del whole
            elif writer and laid[index][0] not in written:  # views of one storage: written once
                offset, placed = laid[index]
                _write(handle, offset, _storage_bytes(placed))
                written.add(offset)


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


def check_sharding(world_size: int, replicate_degree: int, reshard_after_forward: bool | int) -> None:
    """A clear error for a replicate degree that does not divide the world, or an int
    ``reshard_after_forward`` that is not a divisor of the shard group's size other than 1 and itself."""
    if world_size % replicate_degree:
        raise UserError(
            f"replicate_degree {replicate_degree} does not divide the {world_size} ranks: it must be a divisor "
            "(the number of nodes, for HSDP over nodes)"
        )
    shard = world_size // replicate_degree
    if isinstance(reshard_after_forward, bool):
        return
    k = reshard_after_forward
    if not (1 < k < shard and shard % k == 0):
        raise UserError(
            f"reshard_after_forward {k} must be true, false or a divisor of the {shard} ranks of a shard group "
            "other than 1 and itself (e.g. the GPUs of a node)"
        )


def shard_backbone(
    backbone: nn.Module,
    mesh: Any,
    policy: Any,
    reshard_after_forward: bool | int = True,
    root_reshard_after_forward: bool | None = None,
) -> None:
    """One unit per block, then the backbone's own unit (stem, positional terms, norms) around ``forward``
    and every method in ``FORWARD_METHODS``. A backbone with no block list is one unit as a whole. Under a
    reduced-precision policy each BatchNorm is a float32 unit of its own first (as autocast leaves it: its
    float32 running statistics and bf16 weights cannot meet in one kernel). ``reshard_after_forward``: the
    blocks' (FSDP2's argument); ``root_reshard_after_forward`` the root unit's (None: FSDP2's default, which
    keeps a root gathered after forward for the backward that follows)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if policy.param_dtype is not None:  # its running statistics stay float32: so must its weights
        for norm in [m for m in backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
            fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=policy.reduce_dtype))
    for block in blocks(backbone):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(backbone, mesh=mesh, mp_policy=policy, reshard_after_forward=root_reshard_after_forward)
    for method in FORWARD_METHODS:
        if callable(getattr(backbone, method, None)):
            register_fsdp_forward_method(backbone, method)
    _hooks_on_outermost_call(backbone)


def _hooks_on_outermost_call(backbone: nn.Module) -> None:
    """FSDP2's hooks run only around the outermost of the backbone's calls (``forward`` or a method of
    ``FORWARD_METHODS``); the calls made inside it (``forward`` -> ``forward_features`` -> ...) run plain.
    FSDP2 frees the root unit at the end of each inner call (its state is idle by then), so the outer call
    gathered it again: 5 all-gathers of the root unit per step instead of 1."""
    depth = [0]

    def enter(module: nn.Module, args: Any) -> None:
        depth[0] += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] -= 1

    # Outside FSDP2's own forward hooks, which see depth 0 on the outermost call; always_call: an exception
    # in a forward must not leave the count raised (every later call would then skip the gather).
    backbone.register_forward_pre_hook(enter, prepend=False)
    backbone.register_forward_hook(leave, always_call=True)
    for method in FORWARD_METHODS:
        hooked = backbone.__dict__.get(method)  # register_fsdp_forward_method's wrapper
        if hooked is None:
            continue
        plain = getattr(type(backbone), method).__get__(backbone, type(backbone))

        def call(*args: Any, _hooked: Any = hooked, _plain: Any = plain, **kwargs: Any) -> Any:
            outermost = depth[0] == 0
            depth[0] += 1
            try:
                return (_hooked if outermost else _plain)(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(backbone, method, call)


# The networks of a DINO module: the student (trained) and those only run forward without gradients (EMA
# teacher or frozen distillation teacher, Gram teacher, distillation's student EMA).
TRAINED = "student"
FORWARD_ONLY = ("teacher", "gram_teacher", "student_ema")


def _networks(module: nn.Module) -> dict[str, nn.Module]:
    nets = {name: getattr(module, name, None) for name in (TRAINED, *FORWARD_ONLY)}
    return {name: net for name, net in nets.items() if isinstance(net, nn.Module)}


def _shard_rest(net: nn.Module, mesh: Any, policy: Any, reshard_after_forward: bool | None) -> None:
    """Every module of ``net`` that holds parameters not sharded yet becomes a unit of its own, innermost
    first (the heads' linear layers, a distillation projection)."""
    from torch.distributed.fsdp import fully_shard

    for sub in reversed(list(net.modules())):
        own = [p for p in sub.parameters(recurse=False) if not isinstance(p, DTensor)]
        if own:
            fully_shard(sub, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def shard_module(module: nn.Module, mesh: Any, precision: str) -> None:
    """Shard every network of a DINO module over ``mesh`` (``configure_model`` under ``fsdp2``; a 2-D mesh is
    HSDP).

    The backbones go per block (:func:`shard_backbone`); every other module that holds parameters directly
    (the heads' linear layers, a distillation projection) becomes a unit of its own, so it is gathered by
    its own ``forward`` however the step calls it. All networks have the same structure as the student,
    hence the same units and the same shards on every rank (the EMA updates are local). In the networks run
    only forward every unit reshards after its forward, the root units included (the backbone's own, the
    heads' layers): FSDP2 keeps a root gathered for a backward that never comes. The student's blocks follow the
    strategy's ``reshard_after_forward`` (:class:`FSDP2Strategy`); with ``False`` they stay gathered until
    the step's backward has ended (:func:`keep_gathered_through_backward`)."""
    if getattr(module.hparams, "compile", False):
        raise UserError(
            "compile is not supported under --trainer.strategy fsdp2 yet; set --model.compile false"
        )
    policy = _policy(str(module.trainer.precision))
    student_reshard = getattr(getattr(module.trainer, "strategy", None), "reshard_after_forward", False)
    for name, net in _networks(module).items():
        trained = name == TRAINED
        backbone = getattr(net, "backbone", None)
        if isinstance(backbone, nn.Module):
            if trained:
                shard_backbone(backbone, mesh, policy, student_reshard)
            else:
                shard_backbone(backbone, mesh, policy, True, root_reshard_after_forward=True)
            if trained and student_reshard is False:
                keep_gathered_through_backward([*blocks(backbone), backbone])
        if trained:  # all crops through each block in one call: gathered twice a step (MultiCropWrapper)
            net.lockstep_crops = student_reshard is not False
        _shard_rest(net, mesh, policy, None if trained else True)
    _shard_rest(module, mesh, policy, None)  # anything else of the module's own (none in DINO)
    left = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
    if left:  # cannot happen with the rule above; a silent replica would train without gradient reduction
        raise RuntimeError(f"parameters left unsharded under fsdp2: {left[:5]}")


def keep_gathered_through_backward(units: list[nn.Module]) -> None:
    """``units`` (FSDP2 units kept gathered after forward) stay gathered through the whole backward too and
    are resharded when it ends: a block run forward once per crop resolution then has one backward per
    resolution, and FSDP2 would reshard it after the first and gather it again for the next. Gradients are
    still reduce-scattered after each. A forward without gradients (validation, k-NN) reshards at once."""
    from torch.autograd import Variable

    pending = [False]

    def reshard_all() -> None:
        pending[0] = False
        for unit in units:
            unit.reshard()

    def on_gradient(grad: torch.Tensor) -> torch.Tensor:
        if not pending[0]:  # once per backward: the callback runs when the whole backward has ended
            pending[0] = True
            Variable._execution_engine.queue_callback(reshard_all)
        return grad

    def after_forward(unit: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            unit.reshard()
            return
        pending[0] = False  # a backward that failed never ran its callback; queueing twice is harmless
        tensors = output if isinstance(output, (tuple, list)) else [output]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_gradient)
                return

    for unit in units:
        unit.set_reshard_after_backward(False, recurse=False)
        unit.register_forward_hook(after_forward)


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
    squared norms over the mesh's shard dimension in one all-reduce (HSDP's replicas hold the same shards);
    plain tensors take ``torch._foreach_norm``."""
    local = list(local_tensors(tensors))
    norms = torch.stack(torch._foreach_norm(local, 2.0))
    sharded = [isinstance(t, DTensor) for t in tensors]
    if not any(sharded):
        return norms
    if not all(sharded) or any(t.placements != tensors[0].placements for t in tensors):
        raise RuntimeError("per-tensor norms need all tensors sharded alike")
    squares = norms.float().square()
    mesh = tensors[0].device_mesh
    for dim, placement in enumerate(tensors[0].placements):  # HSDP: summed over the shard dimension only
        if placement.is_shard():
            dist.all_reduce(squares, group=mesh.get_group(dim))
    return squares.sqrt().to(norms.dtype)


def load_whole_state(module: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """``module.load_state_dict(state)`` for a whole (unsharded) ``state`` that every rank holds. Under FSDP2
    each tensor whose place in the module is sharded is first cut to this rank's slice locally (no
    communication); the module's own ``load_state_dict`` then runs, with its overrides and every submodule's
    extra state."""
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        module.load_state_dict(state, strict=strict)
        return
    reshard(module)
    current = module.state_dict()
    state = dict(state)
    for key, value in state.items():
        placed = current.get(key)
        if isinstance(placed, DTensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(placed.shape):
                raise RuntimeError(
                    f"{key} has shape {tuple(value.shape)}, the model's is {tuple(placed.shape)}"
                )
            state[key] = local_slice(value, placed)
    module.load_state_dict(state, strict=strict)


def local_slice(whole: torch.Tensor, like: DTensor, copy: bool = False) -> DTensor:
    """This rank's slice of the whole tensor ``whole``, placed as ``like``: cut where ``whole`` lies (a
    memory-mapped checkpoint: only the slice's pages are read) and only then moved to ``like``'s device and
    dtype; no communication. ``copy``: a tensor of its own even when no move was needed (not a view of
    ``whole``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(whole.shape) != tuple(like.shape):
        raise RuntimeError(
            f"a whole tensor of shape {tuple(whole.shape)} for a place of shape {tuple(like.shape)}"
        )
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    local = whole
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        local = local.narrow(dim, start, size)
    device = like.to_local().device
    local = local.to(device=device, dtype=like.dtype, copy=copy).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _optimizer_slices(entry: dict[str, Any], param: Any) -> dict[str, Any]:
    """One parameter's whole optimiser state (``exp_avg``, ``momentum_buffer``, ...) cut to this rank's slices
    of the (sharded) parameter; a scalar ``step`` and the state of an unsharded parameter copied whole."""
    sliced = {}
    for key, value in entry.items():
        if not isinstance(value, torch.Tensor):
            sliced[key] = value
        elif isinstance(param, DTensor) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape):
            sliced[key] = local_slice(value, param, copy=True)
        else:  # a copy: never a view of the memory-mapped file the optimiser would then update
            sliced[key] = value.clone()
    return sliced


def whole_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with whole tensors: FSDP2's shards gathered (every rank must call it), plain
    tensors as they are; detached copies."""
    reshard(module)
    state = module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
