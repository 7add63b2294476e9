"""``ssl_xcit.trainer.cuda_autocast``: CUDA autocast's op lists and policies applied to CPU tensors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ssl_xcit.trainer import cuda_autocast as ca

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
# Registered for CUDA beside the shared lists: cuDNN-only kernels (no CPU form to trace), the banned
# binary_cross_entropy (an error under CUDA autocast), and linalg_matrix_sqrth.
CUDA_ONLY = {"cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn", "binary_cross_entropy",
             "linalg_matrix_sqrth"}  # fmt: skip


def _header_list(macro: str) -> list[str]:
    body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", HEADER.read_text(), re.S).group(1)
    return [
        f"{name}.{overload or 'default'}"
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.replace("ADD_NS(", "("))
    ]


@pytest.mark.skipif(not HEADER.is_file(), reason="this torch ships no C++ headers")
def test_op_lists_are_the_installed_torchs_cuda_lists():
    assert list(ca.LOWER_PRECISION_FP) == _header_list("AT_FORALL_LOWER_PRECISION_FP")
    assert list(ca.FP32) == _header_list("AT_FORALL_FP32")
    assert list(ca.FP32_SET_OPT_DTYPE) == _header_list("AT_FORALL_FP32_SET_OPT_DTYPE")
    assert list(ca.PROMOTE) == _header_list("AT_FORALL_PROMOTE")
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE.*?\n\n", HEADER.read_text(), re.S)
    assert re.findall(r'"(norm\.\w+)"', body.group(0)) == list(ca.FP32_APPEND_DTYPE)


def test_op_lists_are_the_ops_with_a_cuda_autocast_kernel():
    registered = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
    }
    if not registered:
        pytest.skip("this torch registers no CUDA autocast kernels")
    assert {op.removesuffix(".default") for op in ca.POLICIES} == registered - CUDA_ONLY


def test_documented_ops_get_cudas_dtypes_where_cpu_autocast_differs():
    """amp.rst's "CUDA Ops that can autocast to float16 / to float32": lower precision for matmuls, float32 for
    layer_norm, softmax, log_softmax, norm, sum, exp; CPU autocast keeps those in bfloat16."""
    x = torch.randn(4, 8).bfloat16()
    w = torch.randn(8, 8)
    ops = {
        "layer_norm": lambda: F.layer_norm(x, (8,)),
        "group_norm": lambda: F.group_norm(x.view(4, 2, 4), 2),
        "softmax": lambda: x.softmax(-1),
        "log_softmax": lambda: F.log_softmax(x, dim=-1),
        "norm": lambda: x.norm(dim=-1),
        "sum": lambda: x.sum(),
        "exp": lambda: x.exp(),
        "cumsum": lambda: x.cumsum(0),
    }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {k: f().dtype for k, f in ops.items()} == dict.fromkeys(ops, torch.bfloat16)
    with ca.cuda_autocast(torch.bfloat16):
        assert {k: f().dtype for k, f in ops.items()} == dict.fromkeys(ops, torch.float32)
        assert F.linear(x.float(), w).dtype == torch.bfloat16 and (x.float() @ w).dtype == torch.bfloat16
        assert torch.einsum("ij,jk->ik", x.float(), w).dtype == torch.bfloat16  # CUDA's list, not CPU's
        assert x.softmax(-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype is kept
        assert torch.addcmul(x.float(), x, x).dtype == torch.float32  # promote: the widest input
        assert x.double().exp().dtype == torch.float64  # float64 is not cast
        assert (
            F.cross_entropy(x, torch.tensor([0, 1, 2, 3])).dtype == torch.float32
        )  # via log_softmax, nll_loss
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU kernels are back after the exit
        assert F.layer_norm(x, (8,)).dtype == torch.bfloat16 and x.softmax(-1).dtype == torch.bfloat16
    assert ca.policy("layer_norm") == "fp32" and ca.policy("softmax.int") == "fp32_set_opt_dtype"
    assert ca.policy("linear") == "lower_precision_fp" and ca.policy("add.Tensor") is None


def test_saved_activations_are_float32_under_cudas_policy():
    """Linear -> layer_norm -> softmax on a bfloat16 residual: every byte autograd saves, by dtype. CPU: the
    linear's input, layer_norm's input, mean and rstd, softmax's output, all bfloat16; CUDA: layer_norm's input
    (a float32 copy), its mean and rstd, and softmax's output are float32."""
    n, d = 6, 16
    lin = torch.nn.Linear(d, d, bias=False)
    x = torch.randn(n, d)

    def saved(context) -> tuple[list[torch.dtype], int]:
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            with context:
                out = F.layer_norm(lin(x), (d,)).softmax(-1)
        assert out.grad_fn._saved_result.dtype == seen[-1].dtype
        return [t.dtype for t in seen], sum(t.numel() * t.element_size() for t in seen)

    bf16, f32 = torch.bfloat16, torch.float32
    assert saved(torch.autocast("cpu", dtype=bf16)) == ([bf16] * 5, 3 * n * d * 2 + 2 * n * 2)
    assert saved(ca.cuda_autocast(bf16)) == (
        [bf16, f32, f32, f32, f32],
        n * d * 2 + 2 * n * d * 4 + 2 * n * 4,
    )


def test_weights_are_cast_once_per_region_and_the_policy_is_not_nested():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with Casts() as casts, ca.cuda_autocast(torch.bfloat16):
        lin(x), lin(x)
        with pytest.raises(RuntimeError, match="already active"), ca.cuda_policy():
            pass
    # the input twice, the weight and the bias once (autocast's cache of a weight's cast)
    assert sorted(casts.shapes) == [(2, 8), (2, 8), (8,), (8, 8)]


def test_an_activation_checkpoints_recomputation_casts_as_the_forward():
    """The recomputation in the backward re-enters autocast: under the policy it casts as the forward did
    (float32 layer_norm), or checkpoint refuses the recomputed tensors."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with ca.cuda_policy():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpoint(lambda t: F.layer_norm(lin(t), (8,)).softmax(-1), x, use_reentrant=False)
        assert out.dtype == torch.float32
        out.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
