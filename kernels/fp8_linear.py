"""FP8 (e4m3) linear layers: y = x W^T (+ b) with W stored in float8_e4m3fn and a float32 scale
per output channel ([N]) or per 128x128 block ([N/128, K/128], DeepSeek / Qwen3-FP8's
`weight_scale_inv`).

* Decode rows (up to MAX_GEMV_ROWS): `fp8_gemv`, a Triton GEMV that streams the fp8 weight
  once (half bf16's bytes: what bounds decode) and applies the scales in fp32; the activations
  stay in their own dtype (weight-only at these sizes, no activation rounding). Per-channel
  scales run kernels/gemv.py's GEMV (its tuned tiles; the model fuses the norms and SiLU into
  it as for bf16), block scales `fp8_gemv_legacy`.
* Larger batches, per-channel: activations quantized per token (dynamic, or with a static
  per-tensor input scale) and `torch._scaled_mm` (cuBLASLt, rowwise scales) on the FP8 tensor
  cores: `scaled_mm_per_channel`.
* Larger batches, block-wise: activations quantized per token and 128-column group, then
  `block_fp8_gemm`, a Triton GEMM that multiplies fp8 tiles and applies both scales per
  128-deep k step (vLLM's w8a8 block-FP8 matmul).

Each has a torch reference (`*_ref`: dequantize, matmul in the activation dtype), which is also
the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ipc import envs
from kernels.gemv import gemv
from kernels.jit import runs_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MAX_GEMV_ROWS = 8
BLOCK = 128   # the block scales' side


# --------------------------------------------------------------------------- quantization
def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float) -> (fp8 [N, K], float32 scale [N]): one scale per row (output
    channel), its absolute max mapped to e4m3's largest value."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scale_inv [ceil(N/block), ceil(K/block)])."""
    n, k = w.shape
    pn, pk = -(-n // block) * block, -(-k // block) * block
    wf = F.pad(w.float(), (0, pk - k, 0, pn - n)).view(pn // block, block, pk // block, block)
    scale = (wf.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (wf / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(pn, pk)[:n, :k]
    return q.contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    n, k = q.shape
    s = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, GROUP: tl.constexpr, STATIC: tl.constexpr,
                          BLOCK: tl.constexpr):
    """One program per row (GROUP 0: one scale per row, absmax / 448, or the static scale) or per
    (row, GROUP-column group): the activations' FP8 quantization in one kernel instead of five."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * K
    if GROUP > 0:   # BLOCK == GROUP: this program's group
        cols = tl.program_id(1) * GROUP + offs
        x = tl.load(x_row + cols).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, 1e-12)
        tl.store(q_row + cols, tl.clamp(x / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty))
        tl.store(s_ptr + row * (K // GROUP) + tl.program_id(1), scale)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
            scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, tl.clamp(x / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty),
                     mask=k0 + offs < K)
        tl.store(s_ptr + row, scale)


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    """x [M, K] -> (fp8 [M, K], float32 scale [M, 1]): dynamic per-token scales, or the
    checkpoint's static per-tensor input scale broadcast to every row. No host sync."""
    if runs_triton(_quantize_rows_kernel, x) and x.stride(-1) == 1 and x.shape[0] > 0:
        m, k = x.shape
        q = torch.empty((m, k), dtype=FP8, device=x.device)
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        _quantize_rows_kernel[(m,)](x, q, scale, static_scale if static_scale is not None else scale, k, x.stride(0),
                                    GROUP=0, STATIC=static_scale is not None, BLOCK=1024, num_warps=4)
        return q, scale
    return quantize_per_token_ref(x, static_scale)


def quantize_per_token_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    """quantize_per_token in torch ops (the CPU path's emulation of static input scales)."""
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token_group(x: torch.Tensor, group: int = BLOCK):
    """x [M, K] (K a multiple of group) -> (fp8 [M, K], float32 scale [M, K / group])."""
    m, k = x.shape
    if runs_triton(_quantize_rows_kernel, x) and x.stride(-1) == 1 and m > 0:
        q = torch.empty((m, k), dtype=FP8, device=x.device)
        scale = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
        _quantize_rows_kernel[(m, k // group)](x, q, scale, scale, k, x.stride(0), GROUP=group, STATIC=False,
                                               BLOCK=group, num_warps=1)
        return q, scale
    xf = x.float().view(m, k // group, group)
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k), scale


# --------------------------------------------------------------------------- references
def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   block: int = 0) -> torch.Tensor:
    """Dequantize (per-channel scale [N], or block scale_inv with block > 0) and matmul in x's dtype."""
    wf = dequantize_blocks(w, scale, block) if block else w.float() * scale.float()[:, None]
    return F.linear(x, wf.to(x.dtype), bias)


# --------------------------------------------------------------------------- decode GEMV
@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s, stride_y,
                     SCALE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_N output columns of every row, streaming their [BLOCK_N, K] fp8 slice
    once. Products accumulate per k lane and are summed once after the loop (kernels/gemv.py)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        a = tl.load(x_ptr + offs_m[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        if SCALE_BLOCK > 0:   # BLOCK_N divides SCALE_BLOCK: the tile's rows share their block scales,
            # one per k, which scale x instead of every weight element
            s = tl.load(s_ptr + (pid * BLOCK_N // SCALE_BLOCK) * stride_s + kk // SCALE_BLOCK, mask=k_ok, other=0.0)
            a = a * s[None, :]
        if BLOCK_M == 1:
            acc += w * tl.reshape(a, [BLOCK_K])[None, :]
        else:
            acc += a[:, None, :] * w[None, :, :]
    if BLOCK_M == 1:
        y = tl.sum(acc, 1)[None, :]
    else:
        y = tl.sum(acc, 2)
    if SCALE_BLOCK == 0:
        y = y * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             block: int = 0) -> torch.Tensor:
    """x [M <= MAX_GEMV_ROWS, K] (last dim contiguous), w fp8 [N, K] contiguous, scale float32
    [N] (block 0) or [N/block, K/block] -> y [M, N] in x's dtype."""
    if not runs_triton(_fp8_gemv_kernel, x):
        return fp8_linear_ref(x, w, scale, bias, block)
    if not block and envs.LOOM_FP8_GEMV != "legacy":   # kernels/gemv.py's tuned streaming GEMV
        return gemv(x, w, bias, scale=scale)[0]
    return fp8_gemv_legacy(x, w, scale, bias, block)


def fp8_gemv_legacy(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    block: int = 0) -> torch.Tensor:
    """Session 30's FP8 GEMV: the block-scaled one (and per-channel under LOOM_FP8_GEMV=legacy)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # one row: 4 KiB of fp8 per step and >= 1,000 programs on Llama/Qwen3-8B's shapes; more rows:
    # the [rows, BLOCK_N, BLOCK_K] products in 32 registers a thread
    block_n, block_k, warps = (4, 1024, 4) if m == 1 else (4, 256, 8)
    block_k = min(block_k, triton.next_power_of_2(k))
    while block and block % block_n:
        block_n //= 2
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, scale, bias if bias is not None else scale, y, m, n, k, x.stride(0), w.stride(0),
        scale.stride(0) if block else 0, y.stride(0), SCALE_BLOCK=block, HAS_BIAS=bias is not None,
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y


# --------------------------------------------------------------------------- per-channel GEMM
def scaled_mm_per_channel(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                          input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with rowwise scales: x quantized per token (or by the static input
    scale), w fp8 [N, K] with scale [N]; out in x's dtype (bf16: rowwise scaling needs it)."""
    xq, xs = quantize_per_token(x, input_scale)
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)   # (rowwise scaling takes no bias on every torch build)


# --------------------------------------------------------------------------- block-scaled GEMM
@triton.jit
def _block_fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                           stride_am, stride_bn, stride_cm, stride_as, stride_bs,
                           GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr):
    """C = (A * a_scale) (B * b_scale)^T with A fp8 [M, K] (a scale per row and GROUP columns),
    B fp8 [N, K] (a scale per GROUP x GROUP block); BLOCK_K == GROUP, so each k step has one
    scale per row of A and one per column block of B. Programs run in bands of GROUP_M row
    tiles, so that a band's B tiles come from L2 (vLLM's w8a8 block matmul's order)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    band_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % band_m)
    pid_n = (pid % (GROUP_M * tiles_n)) // band_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m * stride_as
    bs_ptrs = bs_ptr + (offs_n // GROUP) * stride_bs
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
        a_s = tl.load(as_ptrs + k, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + k, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def block_fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   block: int = BLOCK) -> torch.Tensor:
    """x [M, K] (K a multiple of block), w fp8 [N, K], scale_inv float32 [N/block, K/block]
    -> y [M, N] in x's dtype; x is quantized per token and block-wide group first."""
    if not runs_triton(_block_fp8_gemm_kernel, x):
        return fp8_linear_ref(x, w, scale, bias, block)
    m, k = x.shape
    n = w.shape[0]
    xq, xs = quantize_per_token_group(x, block)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    t = block_gemm_tiles(m, n)
    grid = (triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"]),)
    _block_fp8_gemm_kernel[grid](
        xq, w, y, xs, scale, bias if bias is not None else scale, m, n, k, xq.stride(0), w.stride(0), y.stride(0),
        xs.stride(0), scale.stride(0), GROUP=block, HAS_BIAS=bias is not None, BLOCK_K=block, GROUP_M=8, **t)
    return y


def block_gemm_tiles(m: int, n: int) -> dict:
    """The block-scaled GEMM's tiles: 128 x 128 (8 warps, 3 stages) at prefill sizes, as vLLM's
    tuned H100/H200 configs; decode batches take a row tile that fits M and a column tile that
    still gives two programs per SM (128 columns at 16 rows left 32 programs on Qwen3-8B's o)."""
    if m > 256:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = next((b for b in (128, 64) if triton.cdiv(m, bm) * triton.cdiv(n, b) >= 264), 32)
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=4)
