"""W4A16 linear layers (GPTQ, AWQ, compressed-tensors pack-quantized, all repacked to one layout):
y = x W^T (+ b) with W = (q - z) * s, q unsigned 4-bit.

The layout (workers/quantization/w4a16.py repacks every format into it at load time):

    qweight  int32 [K / 8, N]   8 consecutive k of one column n per word, k % 8 in nibble k % 8
    scales   [G, N]             in the activation dtype
    zeros    [G, N]             the zero point z as a float (8 for symmetric formats)
    g_idx    int32 [K] or None  the group of each k (GPTQ act-order); None: k // group_size

* `w4a16_gemv` (decode rows, up to MAX_GEMV_ROWS): one program per BLOCK_N columns streams
  their packed words once, unpacking the 8 nibbles of each word against the 8 matching
  entries of x, in fp32 (the weight read is what bounds decode: a quarter of bf16's bytes).
* `w4a16_gemm` (larger batches): a Triton GEMM dequantizing each [BLOCK_K, BLOCK_N] weight
  tile to the activation dtype and multiplying on the tensor cores.

`w4a16_ref` (dequantize, matmul in the activation dtype) is the torch reference and the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.jit import runs_triton

MAX_GEMV_ROWS = 8


def unpack_k(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] -> the nibbles, int32 [K, N] (0..15)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, qweight.shape[1])


def pack_k(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] (0..15) -> int32 [K / 8, N], the inverse of unpack_k."""
    k, n = q.shape
    q = q.to(torch.int32).reshape(k // 8, 8, n)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
    return (q << shifts[None, :, None]).sum(dim=1, dtype=torch.int32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
               group: int) -> torch.Tensor:
    """W^T, float32 [K, N]."""
    q = unpack_k(qweight).float()
    k = q.shape[0]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group
    return (q - zeros.float()[groups]) * scales.float()[groups]


def w4a16_ref(x: torch.Tensor, qweight, scales, zeros, g_idx, group: int, bias=None) -> torch.Tensor:
    return F.linear(x, dequantize(qweight, scales, zeros, g_idx, group).t().to(x.dtype), bias)


# --------------------------------------------------------------------------- decode GEMV
@triton.jit
def _w4a16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_y,
                       GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """BLOCK_KW packed rows (8 * BLOCK_KW values of k) per step; without g_idx, 8 * BLOCK_KW
    divides GROUP, so a step has one scale and zero row."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BLOCK_KW)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kw0 in range(0, K // 8, BLOCK_KW):
        rows = kw0 + offs_w
        r_ok = rows < K // 8
        words = tl.load(q_ptr + rows[:, None] * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0)
        if not HAS_GIDX:
            g = (kw0 * 8) // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        for i in tl.static_range(8):
            kk = rows * 8 + i
            q = ((words >> (4 * i)) & 0xF).to(tl.float32)
            if HAS_GIDX:
                g = tl.load(g_ptr + kk, mask=r_ok, other=0)
                s2 = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
                z2 = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
                w = (q - z2.to(tl.float32)) * s2.to(tl.float32)
            else:
                w = (q - z[None, :]) * s[None, :]
            a = tl.load(x_ptr + offs_m[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & r_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a[:, :, None] * w[None, :, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_kw(group: int, has_gidx: bool) -> int:
    """Packed rows per GEMV step: 8 * BLOCK_KW values of k, within one group without g_idx."""
    kw = 16
    while not has_gidx and kw > 1 and group % (8 * kw):
        kw //= 2
    return kw


def w4a16_gemv(x: torch.Tensor, qweight, scales, zeros, g_idx, group: int, bias=None) -> torch.Tensor:
    """x [M <= MAX_GEMV_ROWS, K] -> y [M, N] in x's dtype."""
    if not runs_triton(_w4a16_gemv_kernel, x):
        return w4a16_ref(x, qweight, scales, zeros, g_idx, group, bias)
    m, k = x.shape
    n = qweight.shape[1]
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # the widest column tile that still gives >= 256 programs (two per H200 SM: one 4-warp program
    # per SM would keep too few loads in flight on Llama-3.1-8B's o/down; not yet tuned on the GPU)
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= 256), 16)
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, bias if bias is not None else scales, y,
        m, n, k, x.stride(0), y.stride(0), GROUP=group, HAS_GIDX=g_idx is not None, HAS_BIAS=bias is not None,
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_KW=_block_kw(group, g_idx is not None),
        num_warps=4)
    return y


# --------------------------------------------------------------------------- dequantize
@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr,
                       BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr):
    """W^T [K, N] (row-major: stores coalesced along N, as the words are read) in the activation
    dtype from the packed layout, one [8 * BLOCK_KW, BLOCK_N] tile."""
    rows = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < K // 8)[:, None] & (offs_n < N)[None, :]
    words = tl.load(q_ptr + rows[:, None] * N + offs_n[None, :], mask=ok, other=0)
    for i in tl.static_range(8):
        kk = rows * 8 + i
        if HAS_GIDX:
            g = tl.load(g_ptr + kk, mask=rows < K // 8, other=0)
        else:
            g = kk // GROUP
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        w = (((words >> (4 * i)) & 0xF).to(tl.float32) - z) * s
        tl.store(out_ptr + kk.to(tl.int64)[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_to(qweight, scales, zeros, g_idx, group: int, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in dtype (a prefill-sized batch then runs cuBLAS on it)."""
    if not runs_triton(_dequantize_kernel, qweight):
        return dequantize(qweight, scales, zeros, g_idx, group).to(dtype)
    kw, n = qweight.shape
    out = torch.empty((kw * 8, n), dtype=dtype, device=qweight.device)
    _dequantize_kernel[(triton.cdiv(kw, 16), triton.cdiv(n, 64))](
        qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, n, kw * 8, GROUP=group,
        HAS_GIDX=g_idx is not None, BLOCK_KW=16, BLOCK_N=64, num_warps=4)
    return out


# --------------------------------------------------------------------------- GEMM
@triton.jit
def _w4a16_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_y,
                       GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    shifts = (offs_k % 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        words = tl.load(q_ptr + (kk // 8)[:, None] * N + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0)
        q = ((words >> shifts[:, None]) & 0xF).to(tl.float32)
        if HAS_GIDX:
            g = tl.load(g_ptr + kk, mask=k_ok, other=0)[:, None]
        else:
            g = (kk // GROUP)[:, None]
        s = tl.load(s_ptr + g * N + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        w = ((q - z) * s).to(a.dtype)
        acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


DEQUANTIZE_ROWS = 1024   # from here on the weight is dequantized whole and cuBLAS multiplies: the
                         # dequantization is a few percent of a prefill GEMM's time at these sizes


def w4a16_gemm(x: torch.Tensor, qweight, scales, zeros, g_idx, group: int, bias=None) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype (any M; the GEMV is faster at decode rows)."""
    if not runs_triton(_w4a16_gemm_kernel, x):
        return w4a16_ref(x, qweight, scales, zeros, g_idx, group, bias)
    if x.shape[0] >= DEQUANTIZE_ROWS and x.is_cuda:
        y = torch.matmul(x, dequantize_to(qweight, scales, zeros, g_idx, group, x.dtype))
        return y if bias is None else y.add_(bias)
    m, k = x.shape
    n = qweight.shape[1]
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 128, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, bias if bias is not None else scales, y,
        m, n, k, x.stride(0), y.stride(0), GROUP=group, HAS_GIDX=g_idx is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return y
