"""transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (NeoX style, rotate_half) as one kernel,
for the generic path (workers/models/transformers.py), where the HF attention module rotates q
and k itself: in HF's ops that is about ten elementwise launches per layer (two products, a
slice, a negation, a concatenation and a sum, for q and for k), which at decode sizes cost
more than the math. Native models rotate inside the attention prologue (kernels/qk_rope_cache.py).

q [1, Hq, T, D] and k [1, Hkv, T, D] (any strides, last dim contiguous), cos and sin [1, T, R]
with R <= D: the first R dims of each head turn (HF's cos holds each frequency twice, once per
half), the rest pass through, as GPT-NeoX's partial rotary does. Computed in fp32 and rounded
once; the outputs are laid out [1, T, H, D] (returned as [1, H, T, D] views), the layout the
paged-attention kernel reads."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import runs_triton


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF's math (partial rotary as GPT-NeoX's)."""
    def rotate(x):
        r = cos.shape[-1]
        xr, rest = x[..., :r], x[..., r:]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        out = xr * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(x_ptr, stride_xh, o_ptr, stride_oh, n_heads, c_lo, c_hi, s_lo, s_hi,
                  HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < n_heads) & (offs < HALF)
    xp = x_ptr + offs_h * stride_xh + offs
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    op = o_ptr + offs_h * stride_oh + offs
    tl.store(op, (x1 * c_lo - x2 * s_lo).to(dtype), mask=mask)
    tl.store(op + HALF, (x2 * c_hi + x1 * s_hi).to(dtype), mask=mask)
    if REST > 0:
        offs_r = tl.arange(0, BLOCK_REST)[None, :]
        mask_r = (offs_h < n_heads) & (offs_r < REST)
        xr = tl.load(x_ptr + offs_h * stride_xh + 2 * HALF + offs_r, mask=mask_r, other=0.0)
        tl.store(o_ptr + offs_h * stride_oh + 2 * HALF + offs_r, xr.to(dtype), mask=mask_r)


@triton.jit
def _apply_rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                         stride_qh, stride_qt, stride_kh, stride_kt, stride_qot, stride_kot, stride_ct,
                         num_q_heads, num_kv_heads,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_HQ: tl.constexpr,
                         BLOCK_HKV: tl.constexpr):
    """Program (t, 0): token t's query heads; (t, 1): its key heads."""
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    m = offs < HALF
    c_lo = tl.load(cos_ptr + t * stride_ct + offs, mask=m, other=0.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=m, other=0.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + t * stride_ct + offs, mask=m, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + t * stride_ct + HALF + offs, mask=m, other=0.0).to(tl.float32)
    if part == 0:
        _rotate_heads(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * stride_qot, HEAD_DIM, num_q_heads,
                      c_lo, c_hi, s_lo, s_hi, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, BLOCK_HQ)
    else:
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, ko_ptr + t * stride_kot, HEAD_DIM, num_kv_heads,
                      c_lo, c_hi, s_lo, s_hi, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, BLOCK_HKV)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Triton version of apply_rotary_ref (same arguments, same results up to rounding once)."""
    if not runs_triton(_apply_rotary_kernel, q):
        return apply_rotary_ref(q, k, cos, sin)
    _, hq, t, d = q.shape
    hkv = k.shape[1]
    r = cos.shape[-1]
    assert q.shape[0] == k.shape[0] == cos.shape[0] == 1 and cos.shape == sin.shape and r % 2 == 0 and r <= d
    assert q.stride(-1) == k.stride(-1) == 1
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty((1, t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((1, t, hkv, d), dtype=k.dtype, device=k.device)
    if t:
        half, rest = r // 2, d - r
        _apply_rotary_kernel[(t, 2)](
            q, k, q_out, k_out, cos, sin, q.stride(1), q.stride(2), k.stride(1), k.stride(2),
            q_out.stride(1), k_out.stride(1), cos.stride(1), hq, hkv,
            HEAD_DIM=d, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), REST=rest,
            BLOCK_REST=triton.next_power_of_2(max(rest, 1)), BLOCK_HQ=triton.next_power_of_2(hq),
            BLOCK_HKV=triton.next_power_of_2(hkv), num_warps=4)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)
