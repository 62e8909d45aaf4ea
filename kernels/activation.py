"""Gated activations of x [T, 2I] (gate and up side by side):
SwiGLU, silu_and_mul(x) = silu(x[:, :I]) * x[:, I:], and GeGLU (Gemma),
gelu_tanh_and_mul(x) = gelu_tanh(x[:, :I]) * x[:, I:].

Numerics follow HF (act_fn(gate) * up in the model dtype): the activation
computed in fp32 and rounded to x.dtype, then the product computed in fp32 and
rounded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.jit import pdl_args, pdl_wait, runs_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """HF's `gelu_pytorch_tanh` (GELUTanh) on the gate, times up."""
    i = x.shape[-1] // 2
    return F.gelu(x[..., :i], approximate="tanh") * x[..., i:]


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, n_cols, GELU: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """act(gate) * up, act SiLU or (GELU) GELU-tanh: a constexpr, so each compiles to its own."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # 0.5 * a * (1 + tanh(y)) == a * sigmoid(2y), y = sqrt(2/pi) * (a + 0.044715 a^3): no tanh
        # needed, and no cancellation in 1 + tanh(y) where y is very negative
        act = a / (1.0 + tl.exp(-1.5957691216057308 * (a + 0.044715 * a * a * a)))
    else:
        act = a / (1.0 + tl.exp(-a))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (last dim contiguous) -> new [..., I] in x.dtype."""
    if not runs_triton(_act_and_mul_kernel, x):
        return silu_and_mul_ref(x)
    return _launch(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (last dim contiguous) -> new [..., I] in x.dtype."""
    if not runs_triton(_act_and_mul_kernel, x):
        return gelu_tanh_and_mul_ref(x)
    return _launch(x, gelu=True)


def _launch(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    two_i = x.shape[-1]
    assert two_i % 2 == 0
    i = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], i), dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    if n_rows == 0 or i == 0:
        return out
    block = min(2048, triton.next_power_of_2(i))
    _act_and_mul_kernel[(n_rows, triton.cdiv(i, block))](
        x2, out, x2.stride(0), i, GELU=gelu, BLOCK=block, num_warps=4 if block >= 1024 else 2, **pdl_args(x),
    )
    return out
