"""The meta-device start under FSDP2: networks built on the meta device, sharded, then materialised shard by shard
with exactly the weights a whole construction under the same seed gives.

Construction runs under ``torch.device("meta")`` with a recorder (:func:`record`) that logs every aten op it makes
(factories, each family's own init: ``uniform_``, ``normal_``, ``trunc_normal_``'s steps, fills, copies). Nothing is
allocated and the RNG does not move. :func:`replay` later runs that log for real, in order, from the RNG state the
construction started from, so every random draw is the one a whole construction makes; each tensor is allocated
whole only while its value is still needed (a value that a later op overwrites whole, such as PyTorch's default
init before timm's, is drawn into a temporary and dropped at once) and handed to a sink (slice this rank's shard,
copy it in) after its last use. The peak is the largest tensor or so, not the model; the RNG is left as it was.

Switched on by :func:`meta_start` (the CLI does it for ``--trainer.strategy fsdp2``): ``DINO.__init__`` then
builds its networks through :func:`record` and ``configure_model`` materialises them (:func:`materialise`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_ENABLED = [False]

# Ops that write every element of their (whole-storage) target without reading it.
_OVERWRITES = {
    "uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_", "cauchy_",
    "log_normal_", "geometric_",
}  # fmt: skip


def set_meta_start(enabled: bool) -> None:
    """Whether the DINO modules constructed from now on build their networks on the meta device."""
    _ENABLED[0] = bool(enabled)


def meta_start_enabled() -> bool:
    return _ENABLED[0]


@contextlib.contextmanager
def meta_start(enabled: bool = True) -> Iterator[None]:
    """DINO modules constructed inside build on the meta device (for ``--trainer.strategy fsdp2``)."""
    before = _ENABLED[0]
    set_meta_start(enabled)
    try:
        yield
    finally:
        set_meta_start(before)


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class _Entry:
    func: Any
    args: tuple
    kwargs: dict
    out: Any
    writes: list[int] = field(default_factory=list)  # storages written (mutated or created)
    fresh: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # storages created, by an output
    reads: list[int] = field(default_factory=list)
    overwritten: list[int] = field(default_factory=list)  # written whole without being read
    rng: bool = False


@dataclass
class Recipe:
    """A construction recorded on the meta device: its aten ops in order and the CPU RNG state it started from."""

    rng_state: torch.Tensor
    default_dtype: torch.dtype = torch.float32
    entries: list[_Entry] = field(default_factory=list)
    created: set[int] = field(default_factory=set)  # storages the recorded ops created


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.recipe = recipe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        entry = _Entry(func, args, kwargs, out, rng=torch.Tag.nondeterministic_seeded in func.tags)
        for t in _tensors((args, kwargs)):  # a meta tensor made below the dispatcher (torch.tensor): ours too
            if t.is_meta:
                self.recipe.created.add(_sid(t))
        inputs = {id(t) for t in _tensors((args, kwargs))}
        in_sids = {_sid(t) for t in _tensors((args, kwargs))}
        mutated: list[torch.Tensor] = []
        names = [a.name for a in schema.arguments]
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(names[i])
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                mutated.append(value)
        for t in _tensors(out):
            if id(t) not in inputs and _sid(t) not in in_sids:
                entry.fresh.append((_sid(t), t))
                self.recipe.created.add(_sid(t))
        mutated_ids = {id(t) for t in mutated}
        name = func.overloadpacket.__name__
        for t in mutated:
            entry.writes.append(_sid(t))
            whole = t.storage_offset() == 0 and t.is_contiguous()
            whole = whole and t.numel() * t.element_size() == t.untyped_storage().nbytes()
            if name in _OVERWRITES and whole:
                entry.overwritten.append(_sid(t))
            else:
                entry.reads.append(_sid(t))
        entry.writes += [s for s, _ in entry.fresh]
        is_view = not entry.fresh and not mutated
        if not is_view:
            entry.reads += [_sid(t) for t in _tensors((args, kwargs)) if id(t) not in mutated_ids]
        self.recipe.entries.append(entry)
        return out


# torch.nn.init's functions that return at once on a meta tensor (their draws depend on the values: trunc_normal_'s
# rejection loop): recorded as one op each, replayed by calling them on the real tensor.
_INITS = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _recorded_init(recipe: Recipe, original: Callable[..., Any]) -> Callable[..., Any]:
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_meta:
            return original(tensor, *args, **kwargs)
        s = _sid(tensor)
        recipe.created.add(s)
        whole = tensor.storage_offset() == 0 and tensor.is_contiguous()
        whole = whole and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
        overwrites = original.__name__ in ("_no_grad_trunc_normal_", "orthogonal_") and whole
        entry = _Entry(original, (tensor, *args), kwargs, tensor, writes=[s], rng=True)
        (entry.overwritten if overwrites else entry.reads).append(s)
        recipe.entries.append(entry)
        return tensor

    return init


@contextlib.contextmanager
def record() -> Iterator[Recipe]:
    """Build modules inside on the meta device; the recipe replays their construction for real."""
    import torch.nn.init as init

    recipe = Recipe(rng_state=torch.get_rng_state(), default_dtype=torch.get_default_dtype())
    originals = {name: getattr(init, name) for name in _INITS}
    try:
        for name, original in originals.items():
            setattr(init, name, _recorded_init(recipe, original))
        with torch.device("meta"), _Recorder(recipe):
            yield recipe
    finally:
        for name, original in originals.items():
            setattr(init, name, original)


def replay(
    recipe: Recipe,
    sinks: dict[int, list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]],
    device: torch.device | str = "cpu",
) -> int:
    """Run ``recipe`` for real on ``device`` from its RNG state. ``sinks`` maps a recorded storage (``storage_id``)
    to (recorded tensor, sink) pairs: each sink gets the tensor's final value (whole, on ``device``) once, after
    the storage's last use, and the storage is freed. Values nothing needs are never kept; the random draws are
    all made, in order, from a fork of the CPU RNG: the caller's RNG state is left as it was (as Lightning's
    strategies re-seed after a whole construction, nothing after setup depends on what it drew). Returns the
    most bytes the replay held at once."""
    entries = recipe.entries
    # Backwards: which ops must run (random draws always; others when a needed value depends on them), and
    # the last op that touches each storage.
    needed = {s for s in sinks if s in recipe.created}
    live = [False] * len(entries)
    # Per op, the storages it touches whose value a later op (or a sink) still needs.
    keep_after: list[set[int]] = [set() for _ in entries]
    last: dict[int, int] = {}
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        if not (e.rng or any(s in needed for s in e.writes)):
            continue
        live[i] = True
        touched = set(e.writes + e.reads)
        keep_after[i] = {s for s in touched if s in needed}
        for s in touched:
            last.setdefault(s, i)
        for s in e.writes:
            if s in e.overwritten or any(s == f for f, _ in e.fresh):
                needed.discard(s)
        needed.update(e.reads)
    real: dict[int, torch.UntypedStorage] = {}
    nbytes: dict[int, int] = {}
    filled: set[int] = set()
    peak = 0

    def resolve(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        s = _sid(t)
        if s not in recipe.created:
            return t  # a tensor from outside the recording (a constant): as it is
        if s not in real:  # a value nothing reads before it is overwritten: a temporary
            real[s] = torch.UntypedStorage(nbytes.get(s, t.untyped_storage().nbytes()), device=device)
        return torch.empty(0, dtype=t.dtype, device=device).set_(
            real[s], t.storage_offset(), t.size(), t.stride()
        )

    def kwarg(k: str, v: Any) -> Any:
        if k == "device" and v is not None and torch.device(v).type == "meta":
            return torch.device(device)
        return resolve(v)

    for sid, pairs in sinks.items():
        if sid not in recipe.created and not pairs[0][0].is_meta:  # made outside the recording: already real
            for tensor, sink in pairs:
                sink(tensor)
            filled.add(sid)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(recipe.rng_state)
        for i, e in enumerate(entries):
            if not live[i]:
                continue
            args = tree_map(resolve, e.args)
            kwargs = {k: kwarg(k, v) for k, v in e.kwargs.items()}
            out = e.func(*args, **kwargs)
            outs = _tensors(out)
            for s, meta in e.fresh:
                produced = next(o for o, m in zip(outs, _tensors(e.out), strict=True) if m is meta)
                real[s] = produced.untyped_storage()
                nbytes[s] = meta.untyped_storage().nbytes()
            del out, outs, args, kwargs
            peak = max(peak, sum(r.nbytes() for r in real.values()))
            for s in set(e.writes + e.reads):
                if last.get(s) == i:
                    for tensor, sink in sinks.get(s, ()):
                        sink(resolve(tensor))
                    filled.add(s)
                    real.pop(s, None)
                elif s not in keep_after[i]:  # nothing reads this value again (a draw overwritten later)
                    real.pop(s, None)
    lost = [pairs[0][0] for s, pairs in sinks.items() if s not in filled]
    if lost:  # made from data on the meta device (torch.tensor(...)) and never written: no value to replay
        shapes = [tuple(t.shape) for t in lost[:3]]
        raise RuntimeError(
            f"{len(lost)} tensors of the meta-device construction have no recorded value: {shapes}"
        )
    return peak


@contextlib.contextmanager
def recorded_construction(allowed: bool = True) -> Iterator[Recipe | None]:
    """:func:`record` when :func:`meta_start` is on and ``allowed``, else nothing (a plain construction)."""
    if not (allowed and _ENABLED[0]):
        yield None
        return
    with record() as recipe:
        yield recipe


@contextlib.contextmanager
def meta_device_if(enabled: bool) -> Iterator[None]:
    """Modules built inside go on the meta device when ``enabled`` (ones whose weights are copied later)."""
    with torch.device("meta") if enabled else contextlib.nullcontext():
        yield


def _tensor_at(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attr)


def capture_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a DINO module built by the recipe, by name: the student's parameters and
    buffers, and the teacher's buffers outside its state dict (the rest of the teacher is the student's copy, as
    ``student_and_teacher`` makes it; the Gram teacher is the teacher's). Taken before sharding replaces them."""
    copied = {f"teacher.{k}" for k in module.teacher.state_dict()}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {
        name: t for name, t in named if name.split(".", 1)[0] in ("student", "teacher") and name not in copied
    }


def fill(
    module: nn.Module, recipe: Recipe, targets: dict[str, torch.Tensor], device: torch.device | str
) -> None:
    """Fill ``targets`` (the recorded tensors, by name in ``module``, taken before sharding) from ``recipe``,
    tensor by tensor, into ``module``'s tensors of now (allocated on ``device``: ``to_empty``; each rank's
    shards under FSDP2)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def sink_for(name: str) -> Callable[[torch.Tensor], None]:
        def sink(value: torch.Tensor) -> None:
            current = _tensor_at(module, name)
            with torch.no_grad():
                value = value.to(device=current.device)
                if isinstance(current, DTensor):  # this rank's slice, cut locally
                    placed = distribute_tensor(
                        value, current.device_mesh, current.placements, src_data_rank=None
                    )
                    current.to_local().copy_(placed.to_local())
                else:
                    current.copy_(value)

        return sink

    sinks: dict[int, list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]] = {}
    for name, t in targets.items():
        sinks.setdefault(_sid(t), []).append((t, sink_for(name)))
    with torch.device("cpu"):  # the CPU generator draws, as in a whole construction
        default = torch.get_default_dtype()
        torch.set_default_dtype(recipe.default_dtype)
        try:
            replay(recipe, sinks)
        finally:
            torch.set_default_dtype(default)


def materialise(
    module: nn.Module, recipe: Recipe, targets: dict[str, torch.Tensor], device: torch.device | str
) -> None:
    """Allocate the meta networks of a DINO ``module`` on ``device`` (each rank's shards under FSDP2) and fill
    them from ``recipe``: exactly the weights of the whole construction; the RNG state is left as it is."""
    from ssl_xcit.parallel.fsdp import local_tensors, reshard

    module.student.to_empty(device=device)
    module.teacher.to_empty(device=device)
    fill(module, recipe, targets, device)
    with torch.no_grad():
        reshard(module.teacher)
        student = module.student.state_dict()
        own = module.teacher.state_dict()
        torch._foreach_copy_(list(local_tensors(own.values())), list(local_tensors(student[k] for k in own)))
        gram = getattr(module, "gram_teacher", None)
        if gram is not None:
            gram.to_empty(device=device)
            gram._copy_from(module.teacher.backbone)


def capture_all(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name (the targets of a recipe that built all of it)."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return dict(named)


def is_fsdp2_setting(strategy: Any) -> bool:
    """Whether a ``--trainer.strategy`` value (a registered name, a class path namespace, an instance) is
    FSDP2's."""
    from ssl_xcit.parallel.fsdp import STRATEGY_NAME, WHOLE_NAME, FSDP2Strategy

    if isinstance(strategy, str):
        return strategy in (STRATEGY_NAME, WHOLE_NAME)
    if isinstance(strategy, FSDP2Strategy):
        return True
    return str(getattr(strategy, "class_path", "")).endswith("FSDP2Strategy")
