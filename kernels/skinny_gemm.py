"""y = x W^T (+ b) on tensor cores for decode batches of 9 to 64 rows, with a deterministic
split-K and programmatic dependent launch.

At these sizes a linear of a small model is launch- and latency-bound: cuBLAS takes 5.3-7.9
us on Qwen3-0.6B's weights, whose bytes take 1-3 us, and its kernels cannot overlap the
kernel before them. Here a program owns BLOCK_N output columns of all rows (one [BLOCK_M,
BLOCK_N] tile, the rows padded to 16) over 1/SPLIT_K of K, and loads its first weight tile
before waiting on the kernel that produces x (PDL, kernels/jit.py), so the weight stream
starts while that kernel finishes. SPLIT_K spreads narrow weights (Qwen3-0.6B's o and down:
1,024 columns) over the SMs; the partial sums go to an fp32 workspace and the last program of
a column tile adds them in split order, so results do not depend on timing.

SWAP computes the tile as W x^T: the weight's columns become the MMA's long side (Hopper's
wgmma needs 64), which some shapes prefer. Tiles per weight shape and row bucket are
measured by `python -m bench.tune_gemv --rows 16 32 64` (kernels/gemv_tiles.json);
kernels/gemv.py dispatches here, and to cuBLAS where it measured faster. A norm or SiLU
before the matmul runs as its own kernel: fused in, each program's own pass over every
row of x cost more than that kernel at 16 rows and up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import is_interpreted, pdl_args, pdl_wait

MAX_ROWS = 64  # rows of a call (kernels/gemv.py sends 9 to 64; cuBLAS was faster at 128)
MAX_TILES = 4096  # column tiles of one call: the split-K counters
_MIN_WORKSPACE = 1 << 20  # fp32 elements


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, count_ptr,
    M, N, K, stride_x, stride_w, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w

    # the first weight tile is constant: under PDL it loads while the kernel producing x finishes
    kk = k_lo + offs_k
    w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < k_hi)[None, :], other=0.0)
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < k_hi)[None, :], other=0.0)
    acc = _mma(a, w, acc, SWAP, PRECISION, UPCAST)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k0 + offs_k
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < k_hi)[None, :], other=0.0)
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < k_hi)[None, :], other=0.0)
        acc = _mma(a, w, acc, SWAP, PRECISION, UPCAST)
    if SWAP:
        acc = tl.trans(acc)

    mn_ok = m_ok[:, None] & n_ok[None, :]
    last = True
    if SPLIT_K > 1:  # partials to the workspace [SPLIT_K, M, N]; the last program of the tile sums them
        part = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, acc, mask=mn_ok)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        last = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.load(part, mask=mn_ok, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                acc += tl.load(part + s * M * N, mask=mn_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (and graph replay)
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mn_ok)


@triton.jit
def _mma(a, w, acc, SWAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T, or its transpose under SWAP.
    PRECISION "ieee" for fp32 models (not TF32: they are the HF-parity runs). UPCAST (the CPU
    interpreter, whose bf16 dot returns garbage): the product in fp32."""
    if UPCAST:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP:
        out = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        out = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return out


_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown workspaces: CUDA graphs captured with them still use them


def _workspace(device: torch.device, n: int, split_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials (fp32) and the per-tile counters (zero between calls) of a device.
    Sized for MAX_ROWS rows, so a shape's calls at any batch share one buffer; the tuned tiles
    all fit the first 4 MiB (bench.tune_gemv splits K only up to 2 programs per SM)."""
    ws, counts = _WORKSPACE.get(device, (None, None))
    need = split_k * MAX_ROWS * n
    if ws is None or ws.numel() < need:
        if ws is not None:
            _RETIRED.append(ws)
        ws = torch.empty(max(need, _MIN_WORKSPACE), dtype=torch.float32, device=device)
        counts = counts if counts is not None else torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
        _WORKSPACE[device] = (ws, counts)
    return ws, counts


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: dict,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (last dim contiguous), weight [N, K] contiguous -> y [M, N] in
    x.dtype (into `out` when given), with `tiles` from gemv.tile_config."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.is_contiguous() and x.stride(-1) == 1 and m <= MAX_ROWS
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    split_k = tiles.get("split_k", 1)
    grid = (triton.cdiv(n, tiles["block_n"]), split_k)
    assert grid[0] <= MAX_TILES
    ws, counts = _workspace(x.device, n, split_k)
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, y, ws, counts,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tiles["block_n"],
        BLOCK_K=tiles["block_k"], SPLIT_K=split_k, SWAP=tiles.get("swap", False),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=is_interpreted(_skinny_gemm_kernel),
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], **pdl_args(x),
    )
    return y
