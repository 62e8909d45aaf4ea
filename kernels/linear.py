"""y = x W^T (+ b) for decode-sized batches: a weight-streaming Triton matmul.

At a few rows, a linear layer is a read of its weight matrix; cuBLAS picks
split-K tiles there that reach about a quarter of HBM bandwidth on Qwen3-0.6B's
shapes (bench/RESULTS.md). Here each program owns BLOCK_N output columns for
all (up to BLOCK_M) rows and streams its [BLOCK_N, K] slice of W once, so the
whole weight is read once per call with no reduction pass.

`linear` uses the kernel where it beats cuBLAS (use_skinny) on CUDA in
bf16/fp16, and F.linear otherwise (the reference, and prefill's large matmuls).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.jit import step_jit

MAX_ROWS = 4


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@step_jit(ints=("M",), pointers=("x_ptr",))
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter's tl.dot mishandles bf16/fp16 operands
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def tile_config(n: int, k: int) -> dict:
    """BLOCK_N / BLOCK_K / warps / stages per weight shape, from bench/tune_linear.py on an H200."""
    return dict(block_n=16 if n <= 1024 else 32, block_k=128, num_warps=4, num_stages=4)


def use_skinny(m: int, n: int, k: int) -> bool:
    """Where the kernel beats cuBLAS (bench/tune_linear.py, H200): at one to a few rows,
    when there are enough output columns to give every SM a slice (N >= K / 2). At one
    row: Qwen3-0.6B's o_proj 12.3 -> 5.4 us, Llama-3.1-8B's gate_up 59.8 -> 55.3 us; at 16
    rows cuBLAS is as fast, and with N < K / 2 (down_proj) it is faster."""
    return m <= MAX_ROWS and 2 * n >= k


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: dict | None = None) -> torch.Tensor:
    """The Triton kernel for x [M <= 16, K] (last dim contiguous), weight [N, K]
    contiguous; y [M, N] in x's dtype. `tiles` overrides tile_config (tuning)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= 16 and weight.shape[1] == k and weight.is_contiguous() and x.stride(-1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    t = tiles or tile_config(n, k)
    _skinny_linear_kernel[(triton.cdiv(n, t["block_n"]),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_N=n % t["block_n"] == 0, EVEN_K=k % t["block_k"] == 0,
        BLOCK_M=16, BLOCK_N=t["block_n"], BLOCK_K=t["block_k"],
        DOT_F32=type(_skinny_linear_kernel).__name__ == "InterpretedFunction",
        num_warps=t["num_warps"], num_stages=t["num_stages"],
    )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with decode-sized bf16/fp16 batches on the GPU through the Triton kernel."""
    if (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and use_skinny(x.shape[0], weight.shape[0], weight.shape[1])
            and weight.is_contiguous() and x.stride(-1) == 1):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
