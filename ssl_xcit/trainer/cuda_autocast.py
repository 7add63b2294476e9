"""CUDA's autocast policy on CPU tensors, for ``ssl-xcit plan``'s trace on a machine without a GPU.

CPU and CUDA autocast cast different operators. On CUDA, ``layer_norm``, ``softmax``, ``log_softmax``,
``norm``, ``sum``, ``exp`` and the rest of CUDA's float32 lists run in float32, so a bfloat16 input is saved
for the backward as a float32 copy (or the op's float32 output is); CPU autocast leaves them in bfloat16. A
trace under CPU autocast therefore misses memory a GPU spends. :func:`cuda_policy` makes CPU autocast cast
with CUDA's op lists instead: for its duration, the ``AutocastCPU`` kernels of the operators in CUDA's lists
apply CUDA's policy for that operator, and CPU-only autocast kernels fall through (a
``torch.library.Library`` registration, undone on exit); :func:`cuda_autocast` is it with
``torch.autocast("cpu")``. Casts stay above autograd, as autocast's
own do, so the saved tensors are the ones CUDA saves.

The op lists are those of torch's ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``), which ``autocast_mode.cpp`` registers for CUDA; ``docs/source/amp.rst`` documents the
same lists as "CUDA Ops that can autocast to float16/float32".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

# (operator, overload); "default" is the overload with no name.
LOWER_PRECISION_FP: tuple[str, ...] = (
    "_convolution.deprecated", "_convolution.default", "conv1d.default", "conv2d.default", "conv3d.default",
    "conv_tbc.default", "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution.default", "prelu.default", "addmm.default", "addmv.default", "addr.default", "matmul.default",
    "einsum.default", "mm.default", "mv.default", "linalg_vecdot.default", "linear.default", "addbmm.default",
    "baddbmm.default", "bmm.default", "chain_matmul.default", "linalg_multi_dot.default",
    "_thnn_fused_lstm_cell.default", "_thnn_fused_gru_cell.default", "lstm_cell.default", "gru_cell.default",
    "rnn_tanh_cell.default", "rnn_relu_cell.default", "_scaled_dot_product_flash_attention.default",
    "scaled_dot_product_attention.default",
)  # fmt: skip
FP32: tuple[str, ...] = (
    "acos.default", "asin.default", "cosh.default", "erfinv.default", "exp.default", "expm1.default",
    "log.default", "log10.default", "log2.default", "log1p.default", "reciprocal.default", "rsqrt.default",
    "sinh.default", "tan.default", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus.default",
    "layer_norm.default", "native_layer_norm.default", "rms_norm.default", "group_norm.default",
    "frobenius_norm.dim", "nuclear_norm.default", "nuclear_norm.dim", "cosine_similarity.default",
    "poisson_nll_loss.default", "cosine_embedding_loss.default", "nll_loss.default", "nll_loss2d.default",
    "hinge_embedding_loss.default", "kl_div.default", "l1_loss.default", "smooth_l1_loss.default",
    "huber_loss.default", "mse_loss.default", "margin_ranking_loss.default", "multilabel_margin_loss.default",
    "soft_margin_loss.default", "triplet_margin_loss.default", "multi_margin_loss.default",
    "binary_cross_entropy_with_logits.default", "dist.default", "pdist.default", "cdist.default",
    "renorm.default", "logsumexp.default", "upsample_nearest1d.default", "_upsample_nearest_exact1d.default",
    "upsample_nearest2d.default", "_upsample_nearest_exact2d.default", "upsample_nearest3d.default",
    "_upsample_nearest_exact3d.default", "upsample_linear1d.default", "upsample_bilinear2d.default",
    "_upsample_bilinear2d_aa.default", "upsample_trilinear3d.default", "upsample_bicubic2d.default",
    "_upsample_bicubic2d_aa.default",
)  # fmt: skip
# float32 output through the op's own optional dtype argument (no float32 copy of the input)
FP32_SET_OPT_DTYPE: tuple[str, ...] = (
    "prod.default", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod.default", "cumsum.default",
    "linalg_vector_norm.default", "linalg_matrix_norm.default", "linalg_matrix_norm.str_ord", "sum.default",
    "sum.dim_IntList",
)  # fmt: skip
# the overload called instead, with dtype float32 appended
FP32_APPEND_DTYPE: dict[str, str] = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
PROMOTE: tuple[str, ...] = (
    "addcdiv.default", "addcmul.default", "atan2.default", "bilinear.default", "cross.default", "dot.default",
    "vdot.default", "grid_sampler.default", "index_put.default", "tensordot.default", "scatter_add.default",
)  # fmt: skip
POLICIES = {
    **{op: "lower_precision_fp" for op in LOWER_PRECISION_FP},
    **{op: "fp32" for op in FP32},
    **{op: "fp32_set_opt_dtype" for op in FP32_SET_OPT_DTYPE},
    **{op: "fp32_append_dtype" for op in FP32_APPEND_DTYPE},
    **{op: "promote" for op in PROMOTE},
}
_KEY = "AutocastCPU"
_ACTIVE = threading.Lock()


def policy(op: str) -> str | None:
    """CUDA autocast's policy for ``op`` (``name.overload``), or None when CUDA autocast leaves it alone."""
    return POLICIES.get(op if "." in op else f"{op}.default")


def _overload(op: str) -> Any:
    name, _, overload = op.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload)


def _eligible(t: Any) -> bool:
    # autocast's is_eligible: a floating tensor of the device autocast runs on, float64 excepted
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.device.type == "cpu"
        and t.dtype != torch.float64
    )


def _map(fn: Any, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return fn(value) if _eligible(value) else value


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _tensors(v)
        elif _eligible(v):
            yield v


def _cpu_only_kernels() -> list[str]:
    """The operators (``aten::name.overload``) with a CPU autocast kernel that CUDA autocast has no kernel for."""
    ours = {f"aten::{op.removesuffix('.default')}" for op in POLICIES}
    return sorted(
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and name not in ours
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, _KEY)
    )


class _Kernels:
    """The replacement ``AutocastCPU`` kernels. They cast to the lower precision CPU autocast is set to; the
    lower-precision operators CPU autocast also casts keep its own kernels (the same policy, and its cache of
    the weights' casts, cleared when the autocast region ends)."""

    def __init__(self) -> None:
        self.exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def make(self, op: str) -> Any:
        kind, call = POLICIES[op], _overload(op)
        if kind == "fp32_append_dtype":
            target = _overload(FP32_APPEND_DTYPE[op])
        elif kind == "fp32_set_opt_dtype":
            dtype_at = [a.name for a in call._schema.arguments].index("dtype")

        def cast(to: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
            return call(*_map(to, args), **{k: _map(to, v) for k, v in kwargs.items()})

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(self.exclude):
                if kind == "lower_precision_fp":
                    lower = torch.get_autocast_dtype("cpu")
                    return cast(lambda t: t.to(lower), args, kwargs)
                if kind == "fp32":
                    return cast(lambda t: t.float(), args, kwargs)
                if kind == "promote":
                    found = list(_tensors([*args, *kwargs.values()]))
                    wide = found[0].dtype if found else None
                    for t in found[1:]:
                        wide = torch.promote_types(wide, t.dtype)
                    return cast(lambda t: t.to(wide), args, kwargs)
                if not (args and _eligible(args[0])):  # both fp32 dtype policies look at the first argument
                    return call(*args, **kwargs)
                if kind == "fp32_append_dtype":
                    return target(*args, dtype=torch.float32)
                given = args[dtype_at] if len(args) > dtype_at else kwargs.get("dtype")
                if given is not None:
                    return call(*args, **kwargs)
                return call(*args[:dtype_at], **{**kwargs, "dtype": torch.float32})

        return kernel


@contextlib.contextmanager
def cuda_policy() -> Iterator[None]:
    """While active, CPU autocast casts with CUDA's op lists and policies (wherever CPU autocast is enabled:
    also in an activation checkpoint's recomputation during the backward, which re-enters autocast)."""
    if not _ACTIVE.acquire(blocking=False):
        raise RuntimeError("cuda_policy is already active in this process (its kernels are process-wide)")
    lib = torch.library.Library("aten", "IMPL")
    kernels = _Kernels()
    try:
        for name in _cpu_only_kernels():
            lib.impl(name.removeprefix("aten::"), torch.library.fallthrough_kernel, _KEY)
        for op in POLICIES:
            name = op.removesuffix(".default")
            shared = torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", _KEY)
            if not (POLICIES[op] == "lower_precision_fp" and shared):
                lib.impl(name, kernels.make(op), _KEY)
        yield
    finally:
        lib._destroy()
        _ACTIVE.release()


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """``torch.autocast("cpu", dtype)`` casting as CUDA autocast does (CUDA's op lists and policies)."""
    with cuda_policy(), torch.autocast("cpu", dtype=dtype):
        yield
