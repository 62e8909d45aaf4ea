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

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ipc import envs
from kernels.jit import is_interpreted, runs_triton

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


# =========================================================================== the N x K layout
# What the model runs since session 31 (workers/quantization/w4a16.py repacks into it when it
# can; the [K/8, N] kernels above stay for act-order under tensor parallelism, and as the bench's
# baseline). Per output row n, K-contiguous words, so one program streams whole rows:
#
#     qweight  int32 [N, K / 8]   word (n, j) holds k = 8j + i in nibble i (the transpose of the above)
#     scales   [N, G]             zeros [N, G] (z as a float)
#     perm     int64 [K] or None  act-order: the weight's k are sorted by group at load time, so the
#                                 groups are contiguous; x's columns are permuted once per call
#
# A nibble q becomes a float without an int->float conversion (a quarter-rate instruction on
# the H200, which would bound the kernel below HBM speed): OR-ing it into the top mantissa bits
# of 1.0 gives f = 1 + q / 16 exactly. Then per word of 8 k (one group),
#     sum_i x_i (q_i - z) s = 16 s sum_i x_i f_i - s (16 + z) sum_i x_i
# so each weight element costs a shift, a mask-or and one FMA.
@triton.jit
def _nibble_f32(words, I: tl.constexpr):
    """1 + q / 16 (fp32, exact) for nibble I of each word."""
    if 4 * I <= 19:
        m = (words << (19 - 4 * I)) & 0x780000
    else:
        m = (words >> (4 * I - 19)) & 0x780000
    return (m | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _w4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, NG, stride_x, stride_y,
                    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """One program: BLOCK_N output rows of W, every row of x, streaming their [BLOCK_N, K / 8]
    words once in [BLOCK_N, BLOCK_KW] tiles (8 * BLOCK_KW divides K). A tile within one group
    (8 * BLOCK_KW <= GROUP) loads one scale per row; a wider one a scale per word (from L1).
    Products accumulate per word lane and are summed once after the loop (kernels/gemv.py)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0)   # out-of-range rows read row 0 (no masks in the loop)
    offs_j = tl.arange(0, BLOCK_KW)
    kw = K // 8
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * kw
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_KW], dtype=tl.float32)
    for j0 in range(0, kw, BLOCK_KW):
        jj = j0 + offs_j
        words = tl.load(q_rows + jj[None, :])
        if 8 * BLOCK_KW <= GROUP:
            g = (j0 * 8) // GROUP
            s = tl.load(s_ptr + rows * NG + g).to(tl.float32)[:, None]
            z = tl.load(z_ptr + rows * NG + g).to(tl.float32)[:, None]
        else:
            g = (jj * 8) // GROUP
            s = tl.load(s_ptr + rows[:, None] * NG + g[None, :]).to(tl.float32)
            z = tl.load(z_ptr + rows[:, None] * NG + g[None, :]).to(tl.float32)
        s16 = s * 16.0
        sz = s * (16.0 + z)
        if BLOCK_M == 1:
            inner = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            xs = tl.zeros([BLOCK_KW], dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + jj * 8 + i).to(tl.float32)
                inner += _nibble_f32(words, i) * xi[None, :]
                xs += xi
            acc += s16 * inner - sz * xs[None, :]
        else:
            inner = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_KW], dtype=tl.float32)
            xs = tl.zeros([BLOCK_M, 1, BLOCK_KW], dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + offs_m[:, None] * stride_x + (jj * 8 + i)[None, :], mask=m_ok[:, None],
                             other=0.0).to(tl.float32)[:, None, :]
                inner += _nibble_f32(words, i)[None, :, :] * xi
                xs += xi
            acc += s16[None, :, :] * inner - sz[None, :, :] * xs
    if BLOCK_M == 1:
        y = tl.sum(acc, 1)[None, :]
    else:
        y = tl.sum(acc, 2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_tile(words, s, z, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """words int32 [BLOCK_N, BLOCK_K / 8], s and z fp32 [BLOCK_N] (one group) -> W fp32
    [BLOCK_N, BLOCK_K]: (f - (1 + z/16)) is (q - z) / 16 exactly, both in [1, 2)."""
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    f = ((q << 19) | 0x3F800000).to(tl.float32, bitcast=True)
    f = tl.reshape(f, [BLOCK_N, BLOCK_K])
    return (f - (1.0 + z * 0.0625)[:, None]) * (s * 16.0)[:, None]


@triton.jit
def _w4_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, NG, stride_x, stride_y,
                    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """The fused dequantizing GEMM: each [BLOCK_N, BLOCK_K] weight tile is loaded as int4 words,
    dequantized in registers to the activation dtype and multiplied on the tensor cores
    (BLOCK_K divides GROUP and K: one scale per row of the tile). Programs run in GROUP_M
    row-tile bands so a band's weight tiles are read from L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band_m)
    pid_n = (pid % (GROUP_M * tiles_n)) // band_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_K // 8)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * (K // 8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        words = tl.load(q_rows + (k0 // 8 + offs_j)[None, :])
        g = k0 // GROUP
        s = tl.load(s_ptr + rows * NG + g).to(tl.float32)
        z = tl.load(z_ptr + rows * NG + g).to(tl.float32)
        w = _dequant_tile(words, s, z, BLOCK_N, BLOCK_K).to(a.dtype)
        acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, NG, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """W [N, K] in the activation dtype, one [BLOCK_N, BLOCK_K] tile (BLOCK_K divides GROUP and K)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0)
    words = tl.load(q_ptr + rows.to(tl.int64)[:, None] * (K // 8) + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
    s = tl.load(s_ptr + rows * NG + k0 // GROUP).to(tl.float32)
    z = tl.load(z_ptr + rows * NG + k0 // GROUP).to(tl.float32)
    w = _dequant_tile(words, s, z, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])


def repack_nk(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
              group: int):
    """The [K/8, N] layout -> (qweight [N, K/8], scales [N, G], zeros [N, G], perm or None), or None
    where act-order groups cannot be made contiguous (a row-parallel rank's k span groups that
    other ranks share: the [K/8, N] kernels run those)."""
    k = qweight.shape[0] * 8
    perm = None
    if g_idx is not None:
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], torch.arange(k, device=g_idx.device) // group):
            return None
        if scales.shape[0] != k // group:
            return None
        if torch.equal(perm, torch.arange(k, device=perm.device)):
            perm = None   # act-order in name only (an identity g_idx): no permutation per call
        else:
            qweight = pack_k(unpack_k(qweight)[perm])
    return qweight.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(), perm


def dequantize_nk(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """W float32 [N, K] of the N x K layout (the permuted k order, as the kernels see it)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1).float()
    return (q - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)


def w4a16_nk_ref(x: torch.Tensor, qweight, scales, zeros, perm, group: int, bias=None) -> torch.Tensor:
    """The torch reference of the N x K kernels (and their CPU path)."""
    if perm is not None:
        x = x[:, perm]
    return F.linear(x, dequantize_nk(qweight, scales, zeros, group).to(x.dtype), bias)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def gemv_tiles(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_KW, num_warps, num_stages) of the N x K GEMV, not yet measured: at one row
    4 x 256 words (4 KiB, two 16-byte loads a thread; a tile wider than the group keeps a scale
    and zero per word, so each [BLOCK_N, BLOCK_KW] tensor costs BLOCK_N * BLOCK_KW / 128
    registers a thread) and >= 1,000 programs, all resident, on Llama-3.1-8B's shapes; more rows
    multiply the products' registers, so 4 x 64. LOOM_W4A16_GEMV_TILES ("BLOCK_N,BLOCK_KW,WARPS,
    STAGES") overrides the one-row tiles: bench/quant_kernels.py --sweep times the candidates."""
    override = envs.LOOM_W4A16_GEMV_TILES
    if override and m == 1:   # (the sweep's row count; more rows keep the default's registers)
        bn, bkw, warps, stages = (int(v) for v in override.split(","))
        return bn, bkw, warps, stages
    return 4, 256 if m == 1 else 64, 4, 3


def w4a16_gemv_nk(x: torch.Tensor, qweight, scales, zeros, perm, group: int, bias=None,
                  tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M <= MAX_GEMV_ROWS, K] -> y [M, N] in x's dtype, the N x K layout."""
    if not runs_triton(_w4_gemv_kernel, x):
        return w4a16_nk_ref(x, qweight, scales, zeros, perm, group, bias)
    m, k = x.shape
    n = qweight.shape[0]
    x = x.index_select(1, perm) if perm is not None else x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bn, bkw, warps, stages = tiles or gemv_tiles(m, n, k)
    bkw = _pow2_divisor(k // 8, bkw)   # 8 * BLOCK_KW divides K: the loop has no masks
    if is_interpreted(_w4_gemv_kernel):   # the interpreter runs each program in Python: wide tiles
        bn, bkw = min(64, triton.next_power_of_2(n)), _pow2_divisor(k // 8, 32)
    _w4_gemv_kernel[(triton.cdiv(n, bn),)](
        x, qweight, scales, zeros, bias if bias is not None else scales, y, m, n, k, scales.shape[1],
        x.stride(0), y.stride(0), GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=max(1, triton.next_power_of_2(m)),
        BLOCK_N=bn, BLOCK_KW=bkw, num_warps=warps, num_stages=stages)
    return y


def gemm_tiles(m: int, n: int, k: int, group: int) -> dict:
    """The fused GEMM's tiles per row count: a row tile that fits M, then the widest column tile that
    still gives two programs per SM (decode-sized M is weight-bound: the programs must cover
    the SMs), K steps within one group."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 256 else 128
    bk = _pow2_divisor(math.gcd(k, group), 128 if m <= 64 else 64)
    bn = next((b for b in (128, 64, 32) if triton.cdiv(m, bm) * triton.cdiv(n, b) >= 264), 16)
    warps = 8 if bm * bn >= 128 * 128 else 4
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=4 if bm <= 64 else 3)


def w4a16_gemm_nk(x: torch.Tensor, qweight, scales, zeros, perm, group: int, bias=None,
                  tiles: dict | None = None) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype: the fused dequantizing GEMM (any M >= 1)."""
    m, k = x.shape
    if not runs_triton(_w4_gemm_kernel, x) or k % 16:
        return w4a16_nk_ref(x, qweight, scales, zeros, perm, group, bias)
    n = qweight.shape[0]
    x = x.index_select(1, perm) if perm is not None else x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    t = tiles or gemm_tiles(m, n, k, group)
    grid = (triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"]),)
    _w4_gemm_kernel[grid](x, qweight, scales, zeros, bias if bias is not None else scales, y, m, n, k,
                          scales.shape[1], x.stride(0), y.stride(0), GROUP=group, HAS_BIAS=bias is not None, **t)
    return y


def dequantize_nk_to(qweight, scales, zeros, group: int, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in dtype (the dense path: cuBLAS on it)."""
    n, kw = qweight.shape
    k = kw * 8
    if not runs_triton(_w4_dequant_kernel, qweight) or k % 16:
        return dequantize_nk(qweight, scales, zeros, group).to(dtype)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    bk = _pow2_divisor(math.gcd(k, group), 128)
    _w4_dequant_kernel[(triton.cdiv(n, 64), k // bk)](qweight, scales, zeros, out, n, k, scales.shape[1],
                                                      GROUP=group, BLOCK_N=64, BLOCK_K=bk, num_warps=4)
    return out


def w4a16_linear_nk(x: torch.Tensor, qweight, scales, zeros, perm, group: int, bias=None) -> torch.Tensor:
    """y = x W^T (+ b) for any M, the N x K layout: the GEMV at decode rows, then dequantize-whole +
    cuBLAS; the fused GEMM only below LOOM_W4A16_DENSE_ROWS rows (an A/B switch: on the H200 it
    lost at every row count it ran, one Llama-3.1-8B layer's four linears at 16 / 64 / 256 rows
    403 / 1,217 / 1,210 us against the dense path's 278 / 285 / 355: its dequantization runs per
    row tile, in fp32, and bounds it; bench/RESULTS.md, session 39)."""
    m = x.shape[0]
    if not x.is_cuda:   # the CPU path (models in fp32 on CPU): the reference; the tests run the kernels
        return w4a16_nk_ref(x, qweight, scales, zeros, perm, group, bias)
    if m <= MAX_GEMV_ROWS:
        return w4a16_gemv_nk(x, qweight, scales, zeros, perm, group, bias)
    if m < envs.LOOM_W4A16_DENSE_ROWS:
        return w4a16_gemm_nk(x, qweight, scales, zeros, perm, group, bias)
    x = x.index_select(1, perm) if perm is not None else x
    return F.linear(x, dequantize_nk_to(qweight, scales, zeros, group, x.dtype), bias)
