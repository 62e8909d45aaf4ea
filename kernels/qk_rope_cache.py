"""The attention prologue in one kernel: per-head q/k RMSNorm (Qwen3), rotary
embedding, and the KV-cache write.

Unfused this is up to four launches per layer (q norm, k norm, rotary, cache
write), each a few microseconds of mostly launch latency at decode batch
sizes. Numerics are those of the unfused kernels, rounding included: the norm
as kernels/rms_norm.py, the rotation as kernels/rotary.py, the cache holds the
rotated key and the raw value.

Inputs are q [T, Hq, D], k and v [T, Hkv, D] (views of the fused qkv
projection: token/head strides free, last dim contiguous). Returns the rotated
query as a new contiguous [T, Hq, D]; keys and values go straight into the
paged caches at slot_mapping (slots < 0 are padding and are skipped).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import pdl_args, pdl_wait, runs_triton, step_jit
from kernels.kv_quant import FP8_DTYPE, fp8_scales
from kernels.paged_attention import write_kv_cache_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_embedding_ref


def qk_norm_rope_cache_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                           k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                           mrope_section: tuple[int, ...] | None = None, is_neox_style: bool = True,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    q, k = qk_norm_rope_ref(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, mrope_section, is_neox_style)
    write_kv_cache_ref(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return q


def qk_norm_rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     mrope_section: tuple[int, ...] | None = None,
                     is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The prologue without the cache write: (q, k) normed and rotated, as the cache gets k."""
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache, mrope_section, is_neox_style)


@triton.jit
def _to_cache(x, x_ptr, o_ptr, scale_ptr, FP8: tl.constexpr):
    """x (fp32) as o_ptr stores it: rounded to the model's dtype (x_ptr's), then (an FP8 cache)
    divided by the scale in fp32 and saturated to e4m3's range, as kernels/kv_quant.py's reference."""
    x = x.to(x_ptr.dtype.element_ty)
    if FP8:
        x = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr), -448.0, 448.0).to(o_ptr.dtype.element_ty)
    return x


@triton.jit
def _norm_rope_store(x_ptr, stride_xh, o_ptr, stride_oh, n_heads, w_ptr, eps, cos, sin,
                     HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr,
                     BLOCK_H: tl.constexpr, NEOX: tl.constexpr, scale_ptr, FP8: tl.constexpr):
    """Heads [n_heads, HEAD_DIM] at x_ptr -> normed (optionally) and rotated at o_ptr.
    A head is [rotary dims | rest], rest passed through. The rotary dims are NEOX: [x1 | x2],
    the two halves; else (GPT-J) interleaved pairs, x1 = the even dims and x2 = the odd ones.
    FP8: o_ptr is an FP8 cache, which gets the e4m3 codes of the result / the scale at scale_ptr."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < n_heads) & (offs < HALF)
    if NEOX:
        i1 = offs
        i2 = offs + HALF
    else:
        i1 = 2 * offs
        i2 = 2 * offs + 1
    xp = x_ptr + offs_h * stride_xh
    x1 = tl.load(xp + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + i2, mask=mask, other=0.0).to(tl.float32)
    if REST > 0:
        offs_r = tl.arange(0, BLOCK_REST)[None, :]
        mask_r = (offs_h < n_heads) & (offs_r < REST)
        xr = tl.load(x_ptr + offs_h * stride_xh + 2 * HALF + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty   # the model's: the rounding of the unfused kernels
    if HAS_NORM:
        sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if REST > 0:
            sq += tl.sum(xr * xr, 1)
        rstd = (1.0 / tl.sqrt(sq / HEAD_DIM + eps))[:, None]
        w_mask = offs < HALF
        w1 = tl.load(w_ptr + i1, mask=w_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + i2, mask=w_mask, other=0.0).to(tl.float32)
        # rounded as rms_norm: the normalised value to the dtype, then times the weight
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        if REST > 0:
            wr = tl.load(w_ptr + 2 * HALF + offs_r, mask=offs_r < REST, other=0.0).to(tl.float32)
            xr = ((xr * rstd).to(dtype).to(tl.float32) * wr).to(dtype).to(tl.float32)
    op = o_ptr + offs_h * stride_oh
    tl.store(op + i1, _to_cache(x1 * cos - x2 * sin, x_ptr, o_ptr, scale_ptr, FP8), mask=mask)
    tl.store(op + i2, _to_cache(x2 * cos + x1 * sin, x_ptr, o_ptr, scale_ptr, FP8), mask=mask)
    if REST > 0:
        tl.store(o_ptr + offs_h * stride_oh + 2 * HALF + offs_r, _to_cache(xr, x_ptr, o_ptr, scale_ptr, FP8),
                 mask=mask_r)


@step_jit(ints=("stride_pos_row",), pointers=("pos_ptr", "slot_ptr"))
def _qk_norm_rope_cache_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, cs_ptr, qw_ptr, kw_ptr, eps, stride_pos_row,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot,
    stride_cb, stride_cs, stride_ch, stride_cs_row,
    num_q_heads, num_kv_heads,
    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr,
    SEC1: tl.constexpr, NEOX: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr = False,
):
    """Program (t, 0): token t's query heads. Program (t, 1): its key and value heads
    into the caches (nothing for a padding token). MROPE: positions are [3, T] (row stride
    stride_pos_row) and frequency j < SEC0 turns with row 0, j < SEC0 + SEC1 with row 1,
    the rest with row 2. NEOX: NeoX-style rotary (halves), else GPT-J style (interleaved pairs).
    FP8: the caches are FP8, keys and values quantized with the scales at k_scale_ptr / v_scale_ptr."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_HALF)[None, :]
    c_mask = offs_c < HALF
    if MROPE:
        p0 = tl.load(pos_ptr + t).to(tl.int64)
        p1 = tl.load(pos_ptr + stride_pos_row + t).to(tl.int64)
        p2 = tl.load(pos_ptr + 2 * stride_pos_row + t).to(tl.int64)
        pos = tl.where(offs_c < SEC0, p0, tl.where(offs_c < SEC0 + SEC1, p1, p2))
    else:
        pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs_row + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs_row + HALF + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    if part == 0:
        _norm_rope_store(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * stride_qot, HEAD_DIM, num_q_heads,
                         qw_ptr, eps, cos, sin, HAS_NORM, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, BLOCK_HQ, NEOX,
                         k_scale_ptr, False)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            _norm_rope_store(k_ptr + t * stride_kt, stride_kh, kc_ptr + cache_off, stride_ch, num_kv_heads,
                             kw_ptr, eps, cos, sin, HAS_NORM, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST,
                             BLOCK_HKV, NEOX, k_scale_ptr, FP8)
            offs_h = tl.arange(0, BLOCK_HKV)[:, None]
            offs_d = tl.arange(0, BLOCK_D)[None, :]
            mask = (offs_h < num_kv_heads) & (offs_d < HEAD_DIM)
            val = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
            if FP8:
                val = tl.clamp(val.to(tl.float32) / tl.load(v_scale_ptr), -448.0, 448.0)
            tl.store(vc_ptr + cache_off + offs_h * stride_ch + offs_d, val.to(vc_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                       k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       mrope_section: tuple[int, ...] | None = None, is_neox_style: bool = True,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of qk_norm_rope_cache_ref (same arguments, same results).

    q_weight / k_weight: the per-head RMSNorm weights [D] (both or neither).
    positions: [T], or [3, T] with mrope_section (M-RoPE).
    is_neox_style: False rotates interleaved pairs (GPT-J style: GLM, Cohere).
    k_scale / v_scale: an FP8 cache's scales (fp32 device tensors, read by the kernel; None: 1.0)."""
    if not runs_triton(_qk_norm_rope_cache_kernel, q):
        return qk_norm_rope_cache_ref(positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping,
                                      q_weight, k_weight, eps, mrope_section, is_neox_style, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and value_cache.stride() == key_cache.stride()
    assert (q_weight is None) == (k_weight is None)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == key_cache.stride(-1) == 1, "need a contiguous last dim"
    rot = cos_sin_cache.shape[-1]
    assert rot % 2 == 0 and rot <= head_dim and cos_sin_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    has_norm = q_weight is not None
    if has_norm:
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    half, rest = rot // 2, head_dim - rot
    mrope = positions.dim() == 2
    if mrope:
        assert positions.shape[0] == 3 and mrope_section is not None and sum(mrope_section) == half
        positions = positions if positions.stride(1) == 1 else positions.contiguous()
    else:
        positions = positions.contiguous()
    sec = tuple(mrope_section) if mrope else (half, 0, 0)
    fp8 = key_cache.dtype == FP8_DTYPE
    k_scale, v_scale = fp8_scales(key_cache.device, k_scale, v_scale) if fp8 else (q_out, q_out)
    _qk_norm_rope_cache_kernel[(num_tokens, 2)](
        positions, slot_mapping.contiguous(), q, k, v, q_out, key_cache, value_cache, cos_sin_cache,
        q_weight if has_norm else q_out, k_weight if has_norm else q_out, float(eps),
        positions.stride(0) if mrope else 0, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads,
        HAS_NORM=has_norm, HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        REST=rest, BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
        MROPE=mrope, SEC0=sec[0], SEC1=sec[1], NEOX=is_neox_style, FP8=fp8, num_warps=4, **pdl_args(q),
    )
    return q_out
