"""The memory plan of ``ssl-xcit plan``: the peak memory per GPU of one DINO training step, made without a GPU.

:func:`estimate` builds the run's own module (``ssl_xcit.dino.module.DINO`` or a subclass, as ``ssl-xcit fit``
would; a distillation run's frozen teacher from its shapes alone) on the meta device, gives it fake CPU storages (``FakeTensorMode``: shapes, dtypes and devices but no
memory, so a 7B model costs nothing to hold), makes AdamW's two float32 states with a step on zero gradients,
and then traces one steady-state training step (:func:`forward_backward` and :func:`update`: teacher and
student forwards over all crops under the precision's autocast, losses, backward, centres, clipping, AdamW
step, EMA update) inside torch's own tracker of live storages
(``torch.distributed._tools.mem_tracker.MemTracker``), recording the peak of each phase. The traced peak is
that of the fake CPU device; the same operators allocate the same tensors on a GPU, except where a kernel
keeps an internal workspace. A real-tensor run of the same functions is what ``benchmarks/bench_memory_plan.py``
measures the estimate against.

``fsdp2`` is traced, not derived: the module is sharded with the run's own ``shard_module`` over a fake
process group of the run's world size (``torch.testing._internal.distributed.fake_pg``), so the 1/N shards of
parameters, gradients, AdamW states and teachers, the float32 reductions and each unit's transiently gathered
parameters are tensors the tracker sees. ``ddp`` on more than one GPU adds one analytic term: DDP's gradient
buckets, one more copy of the student's gradients (``gradient_as_bucket_view`` is off, torch's default).

The trace casts as CUDA autocast does (``PlanInput.autocast``, default ``"cuda"``: CUDA's op lists applied to
the CPU tensors by :func:`ssl_xcit.trainer.cuda_autocast.cuda_autocast`; CPU autocast keeps ``layer_norm``,
``softmax``, ``norm`` and ``sum`` in bfloat16, where CUDA saves float32 copies or outputs). ``"cpu"`` traces
CPU autocast's own lists, for comparisons with a real CPU run.

What the trace cannot see is added as stated terms: the caching allocator's fragmentation
(:data:`FRAGMENTATION`), the CUDA context and cuBLAS/cuDNN workspaces (:data:`CUDA_OVERHEAD_GB`) and NCCL's
buffers, :data:`NCCL_COMMUNICATOR_GB` per communicator the strategy creates (:func:`nccl_communicators`).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ssl_xcit.data.crops import gram_crop_side
from ssl_xcit.dino.step import NUM_GLOBAL_CROPS
from ssl_xcit.errors import UserError

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
STRATEGIES = ("ddp", "fsdp2")
AUTOCAST_POLICIES = ("cuda", "cpu")
DEFAULT_MODEL = "ssl_xcit.dino.module.DINO"
# Outside the trace: the CUDA context (about 0.5 GB) and cuBLAS/cuDNN workspaces.
CUDA_OVERHEAD_GB = 1.0
# NCCL's buffers per communicator on each GPU: about 1.6 GB for one communicator after an all-reduce, about
# 6 GB for three or more (NVIDIA/nccl#864); the larger per-communicator figure.
NCCL_COMMUNICATOR_GB = 2.0
# The caching allocator's fragmentation and rounding: the traced peak is raised by this fraction.
FRAGMENTATION = 0.10
GB = 1e9
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class PlanInput:
    """One run to plan: the model's class and its ``init_args``, the crops of a batch, precision, strategy and
    world size (GPUs in all)."""

    model_args: dict[str, Any]
    batch_size: int = 64
    global_crops_size: int = 224
    local_crops_number: int = 8
    local_crops_size: int = 96
    precision: str = "bf16-mixed"
    strategy: str = "ddp"
    world_size: int = 1
    model_class: str = DEFAULT_MODEL
    autocast: str = "cuda"

    def check(self) -> None:
        """A UserError naming the first bad value and what would be valid."""
        if self.autocast not in AUTOCAST_POLICIES:
            raise UserError(f"autocast policy {self.autocast!r} is not one of {', '.join(AUTOCAST_POLICIES)}")
        if self.precision not in PRECISIONS:
            raise UserError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.strategy not in STRATEGIES:
            raise UserError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.strategy == "fsdp2" and self.precision == "16-mixed":
            raise UserError("16-mixed is refused under fsdp2 (as Lightning does); use bf16-mixed or 32")
        for name in ("batch_size", "global_crops_size", "world_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.local_crops_number < 0 or (self.local_crops_number and self.local_crops_size < 1):
            raise UserError(
                f"local crops: number >= 0 and size >= 1, got {self.local_crops_number} x {self.local_crops_size}"
            )
        from ssl_xcit.models import list_models

        backbone = self.model_args.get("backbone", "xcit_small_12_p16")
        if backbone not in list_models():
            raise UserError(f"unknown backbone {backbone!r}; `ssl-xcit models` lists the valid names")


@dataclass
class MemoryPlan:
    """Bytes per GPU. ``parameters`` .. ``teachers`` are what one GPU holds between steps (shards under
    fsdp2); ``step_peak`` and ``update_peak`` are the trace's peaks of live tensors over a steady-state step's
    forwards and backward, and over its update (clipping, optimiser step, EMA); ``traced_peak`` is the larger,
    ``activations`` the rest of it (activations, gathered units, temporaries); ``peak`` adds DDP's buckets,
    fragmentation and the ``overhead`` (CUDA context and workspaces, NCCL's communicators)."""

    parameters: int
    gradients: int
    optimizer: int
    teachers: int
    step_peak: int
    update_peak: int
    ddp_buckets: int
    plan: PlanInput = field(repr=False)

    @property
    def traced_peak(self) -> int:
        return max(self.step_peak, self.update_peak)

    @property
    def activations(self) -> int:
        return max(0, self.traced_peak - self.parameters - self.optimizer - self.teachers)

    @property
    def overhead(self) -> int:
        return overhead(self.plan)

    @property
    def peak(self) -> int:
        traced = self.traced_peak + self.ddp_buckets
        return int(traced * (1 + FRAGMENTATION) + self.overhead)

    def fits(self, gpu_memory_gb: float) -> bool:
        return self.peak <= gpu_memory_gb * GB


def nccl_communicators(plan: PlanInput) -> int:
    """NCCL communicators on each GPU: none on one GPU; DDP's default group; under FSDP2 the default group and
    Lightning's device mesh."""
    if plan.world_size == 1:
        return 0
    return 2 if plan.strategy == "fsdp2" else 1


def overhead(plan: PlanInput) -> int:
    """Bytes outside the trace, fragmentation aside: CUDA context and workspaces, NCCL's buffers."""
    return int((CUDA_OVERHEAD_GB + NCCL_COMMUNICATOR_GB * nccl_communicators(plan)) * GB)


def model_class(path: str) -> type:
    """The LightningModule class of ``path`` (``module.Class``); DINO and its subclasses only."""
    from ssl_xcit.dino.module import DINO

    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, DINO)):
        raise UserError(f"model class {path!r}: ssl-xcit plan plans {DEFAULT_MODEL} and its subclasses")
    return cls


def init_parameters(cls: type) -> set[str]:
    """The arguments ``cls(...)`` takes by name: its own and, where it passes ``**kwargs`` on, its bases'."""
    import inspect

    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def make_crops(plan: PlanInput, device: torch.device | str = "cpu") -> tuple[list, list | None]:
    """A batch's crops as the datamodule gives them (2 global, then the local ones) and, when the model
    anchors, the Gram teacher's crops."""
    b, g, loc = plan.batch_size, plan.global_crops_size, plan.local_crops_size
    crops = [torch.randn(b, 3, g, g, device=device) for _ in range(NUM_GLOBAL_CROPS)]
    crops += [torch.randn(b, 3, loc, loc, device=device) for _ in range(plan.local_crops_number)]
    gram = None
    if plan.model_args.get("gram_loss_weight", 0.0) > 0:
        side = gram_crop_side(g, float(plan.model_args.get("gram_resolution_scale", 1)))  # 1.5 as DINOv3's
        gram = [torch.randn(b, 3, side, side, device=device) for _ in range(NUM_GLOBAL_CROPS)]
    return crops, gram


def _normal_clamped(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: Any = None,
) -> torch.Tensor:
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator).clamp_(a, b)


@contextlib.contextmanager
def _architecture_only() -> Iterator[None]:
    """While a module is built for the plan: a distillation teacher's weights are not read, only its shapes.
    A ``timm:NAME`` teacher is built without its pretrained weights (no download), and a checkpoint file is
    memory-mapped (``torch.load(mmap=True)``: a 7B teacher's file costs nothing to open; the meta device's
    copies never touch its pages)."""
    from unittest import mock

    import timm

    create, load = timm.create_model, torch.load

    def architecture(name: str, pretrained: bool = False, pretrained_cfg_overlay: Any = None, **kwargs: Any):
        return create(name, pretrained=False, **kwargs)

    def mapped(*args: Any, **kwargs: Any) -> Any:
        if "mmap" in kwargs:
            return load(*args, **kwargs)
        try:
            return load(*args, mmap=True, **kwargs)
        except RuntimeError:  # a file of torch's legacy (not zip) format cannot be mapped
            return load(*args, **kwargs)

    with mock.patch.object(timm, "create_model", architecture), mock.patch.object(torch, "load", mapped):
        yield


def _construct(cls: type, args: dict[str, Any], fake_mode: Any) -> Any:
    """``cls(**args)`` with real tensors, or, under ``fake_mode``, built on the meta device (model code may
    read a host value while it builds: timm's drop-path rates, torch's ``trunc_normal_``) and then given fake
    CPU storages (as ``to_empty``); the values of a fake module do not matter, only its tensors' sizes (a
    distillation teacher's too: :func:`_architecture_only`)."""
    if fake_mode is None:
        return cls(**args)
    from unittest import mock

    # torch's trunc_normal_ redraws until no value is out of range, reading the meta tensor on the host.
    with (
        torch.device("meta"),
        mock.patch.object(torch.nn.init, "trunc_normal_", _normal_clamped),
        _architecture_only(),
    ):
        model = cls(**args)
    with fake_mode:  # to_empty's empty_like would hand the meta tensor itself to the fake mode
        return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))


class _TrainerStandIn:
    """What ``shard_module`` and the step read of a Trainer."""

    def __init__(self, precision: str, world_size: int) -> None:
        self.precision, self.world_size = precision, world_size
        self.global_step = self.current_epoch = 0


def build(plan: PlanInput, mesh: Any = None, fake_mode: Any = None) -> tuple[Any, torch.optim.Optimizer]:
    """The run's module and its optimiser as a fit would set them up (training modes, the Gram teacher held,
    sharded over ``mesh`` under fsdp2), with real CPU tensors or the fake ones of ``fake_mode`` (entered by the
    caller for everything after the build)."""
    model = _construct(model_class(plan.model_class), plan.model_args, fake_mode)
    with contextlib.nullcontext() if fake_mode is None else fake_mode:
        return _set_up(model, plan, mesh)


def _set_up(model: Any, plan: PlanInput, mesh: Any) -> tuple[Any, torch.optim.Optimizer]:
    from ssl_xcit.dino.schedules import dino_schedules
    from ssl_xcit.parallel.fsdp import shard_module

    if mesh is not None:
        model._trainer = _TrainerStandIn(plan.precision, plan.world_size)
        try:
            shard_module(model, mesh, plan.precision)
        finally:
            model._trainer = None
    model._set_training_modes()
    # Any run long enough for the warm-ups: the values of the schedules change no tensor's size.
    epochs = 1 + math.ceil(max([v for k, v in model.hparams.items() if k.endswith("_epochs") and v] + [0]))
    model.schedules = dino_schedules(model.hparams, epochs, 100, plan.batch_size, plan.world_size)
    gram = getattr(model, "gram_teacher", None)
    if gram is not None:  # held from the start: the term's weight counts from the first traced step
        gram.initialised = True
        model.gram_weight_now = gram.weight
    model.hparams.freeze_last_layer = 0  # a step after the freeze: every trained parameter has its states
    optimizer = model.configure_optimizers()
    # foreach: torch's default for CUDA tensors (on CPU it takes the per-tensor loop, with smaller temporaries)
    for group in optimizer.param_groups:
        if not group.get("fused"):
            group["foreach"] = True
    return model, optimizer


def init_optimizer_states(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's states as after any step (a step on zero gradients; the states' values do not matter)."""
    for p in model.student.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_steps(model: Any, optimizer: torch.optim.Optimizer, plan: PlanInput, steps: int = 2) -> None:
    """``steps`` of DINO's training step on fresh batches (``DINO.training_step`` and ``window_step`` without a
    Trainer): forwards and losses under the precision's autocast, backward, centres, clipping and last-layer
    freeze, optimiser step, gradients freed, EMA."""
    for step in range(steps):
        forward_backward(model, plan, step)
        update(model, optimizer)


def forward_backward(model: Any, plan: PlanInput, step: int = 0) -> None:
    """A fresh batch, the forwards and losses under the precision's autocast, and the backward."""
    device = next(model.parameters()).device
    crops, gram = make_crops(plan, device)
    masks = model.draw_masks(crops[0], [0, 0, step, 0]) if model.ibot else None
    dtype = _AUTOCAST.get(plan.precision)
    # CUDA's policy on a CPU spans the backward too: activation checkpointing recomputes under autocast there
    with autocast_policy(plan, device):
        with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            out = model.compute_losses(crops, masks, epoch=0, update_center=True, gram_crops=gram)
        out.total.backward()


def autocast_policy(plan: PlanInput, device: torch.device) -> contextlib.AbstractContextManager:
    """On a CPU, under ``plan.autocast == "cuda"`` and a mixed precision: CPU autocast cast as CUDA's does."""
    from ssl_xcit.trainer.cuda_autocast import cuda_policy

    if device.type == "cpu" and plan.autocast == "cuda" and plan.precision in _AUTOCAST:
        return cuda_policy()
    return contextlib.nullcontext()


def update(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """The window's end: centres, clipping and last-layer freeze, optimiser step, gradients freed, EMA."""
    for targets in model._teacher_targets():
        targets.apply_center()
    model.on_before_optimizer_step(optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model._update_teacher(0.996)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A 1-D ``data_parallel`` CPU mesh over a fake process group of ``world_size`` ranks (collectives return
    at once), or None for one rank; the group is destroyed on exit."""
    if world_size == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("ssl-xcit plan traces fsdp2 in a process with no process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def _nbytes(tensors: Iterator[torch.Tensor]) -> int:
    from ssl_xcit.parallel.fsdp import local_tensors

    return sum(t.numel() * t.element_size() for t in local_tensors(tensors))


def _states(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the student (parameters, float32 gradients), of AdamW's states and of the other networks."""
    student = [p for p in model.student.parameters()]
    trained = [p for p in student if p.requires_grad]
    others = [p for n, p in model.named_parameters() if not n.startswith("student.")]
    opt_states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return dict(
        parameters=_nbytes(iter(student)),
        gradients=_nbytes(iter(trained)),
        optimizer=_nbytes(iter(opt_states)),
        teachers=_nbytes(iter(others)),
    )


def _peak_tracker() -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        """torch's ``MemTracker`` (every live storage by its bytes, storage resizes, DTensor's local tensors)
        without its per-module statistics, whose hooks refuse frozen parameters (the teachers) and a module
        called at the top level more than once a step; its peak is the same."""

        def _pre_fw_hook(self, *args: Any) -> None: ...

        def _post_fw_hook(self, *args: Any) -> None: ...

        def _pre_bw_hook(self, *args: Any) -> None: ...

        def _post_bw_hook(self, *args: Any) -> None: ...

    return PeakTracker()


def estimate(plan: PlanInput, activation_checkpointing: bool | None = None) -> MemoryPlan:
    """The memory plan of ``plan`` (``activation_checkpointing`` overrides the model's setting when given)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if activation_checkpointing is not None:
        plan = replace(
            plan, model_args={**plan.model_args, "activation_checkpointing": activation_checkpointing}
        )
    plan.check()
    sharded = plan.strategy == "fsdp2" and plan.world_size > 1
    fake_mode = FakeTensorMode()
    with fake_process_group(plan.world_size if sharded else 1) as mesh, torch.random.fork_rng():
        model, optimizer = build(plan, mesh, fake_mode)
        with fake_mode:
            init_optimizer_states(model, optimizer)  # the steady state: a step after the first
            tracker = _peak_tracker()
            tracker.track_external(model, optimizer)
            with tracker:
                forward_backward(model, plan)
                step_peak = max(tracker._peak_mem.values())
                # The update's own peak, from what is live after the backward on (MemTracker keeps the
                # running peak in this dict; no public reset exists).
                tracker._peak_mem = {d: s["Total"] for d, s in tracker.get_tracker_snapshot().items()}
                update(model, optimizer)
                update_peak = max(tracker._peak_mem.values())
            states = _states(model, optimizer)
    buckets = states["gradients"] if plan.strategy == "ddp" and plan.world_size > 1 else 0
    return MemoryPlan(step_peak=step_peak, update_peak=update_peak, ddp_buckets=buckets, plan=plan, **states)


def max_batch(
    plan: PlanInput, gpu_memory_gb: float, limit: int = 4096, first: int = 8
) -> tuple[int, MemoryPlan | None]:
    """The largest batch per GPU (up to ``limit``) whose plan fits ``gpu_memory_gb``, with its plan; (0, None)
    when not even batch 1 fits. A search over traced estimates from batch ``first`` (a guess): its neighbour,
    then, as the peak grows with the batch almost on a line, where the line through the last two traced
    batches reaches the budget, kept strictly inside the bracket (largest fitting, smallest not fitting), or
    the bracket's midpoint when the line points at a batch already traced. The answer is a traced batch that
    fits next to a traced one that does not (or ``limit``)."""
    budget = gpu_memory_gb * GB
    traced: dict[int, MemoryPlan] = {}

    def at(batch: int) -> MemoryPlan:
        if batch not in traced:
            traced[batch] = estimate(replace(plan, batch_size=batch))
        return traced[batch]

    lo, hi, last, probe = 0, limit + 1, None, max(1, min(first, limit))
    while hi - lo > 1:
        fits = at(probe).fits(gpu_memory_gb)
        lo, hi = (probe, hi) if fits else (lo, probe)
        if last is None:
            nxt = probe + 1 if fits else probe - 1
        else:
            slope = (at(probe).peak - at(last).peak) / (probe - last)
            nxt = probe + math.floor((budget - at(probe).peak) / slope) if slope > 0 else (lo + hi) // 2
        last, nxt = probe, min(max(nxt, lo + 1), hi - 1)
        probe = nxt if nxt not in traced else (lo + hi) // 2
    return lo, traced.get(lo)
