"""Rotary position embedding (NeoX / rotate_half style, as HF Llama and Qwen).

cos_sin_cache is float32 [max_position, rot_dim]: the first rot_dim // 2
columns are cos, the rest sin, over the rot_dim // 2 frequencies. rot_dim is
normally head_dim; a smaller rot_dim rotates only the first rot_dim dims of
each head (partial rotary) and passes the rest through.

For a head x = [x1 | x2] (halves of rot_dim):
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
computed in fp32 and rounded once to the input dtype.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.jit import step_jit


def _inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    # Same expression as transformers' default rope init.
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    return 1.0 / (base ** exps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Same math as transformers.modeling_rope_utils._compute_llama3_parameters.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def build_rope_cache(head_dim: int, max_position: int, base: float, rope_scaling: dict | None,
                     device=None) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos of the head_dim // 2 frequencies, then sin.

    rope_scaling: None, {"rope_type": "default"}, {"rope_type": "linear", "factor"} or {"rope_type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}; the key "type" is accepted for
    "rope_type". Other keys (e.g. "rope_theta") are ignored."""
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default")) or "default"
    inv_freq = _inv_freq(head_dim, base, "cpu")  # on the CPU, as HF computes it at init
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
    t = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq.to(t.device).float())  # same products as HF's inv_freq @ position_ids
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    rot = 2 * half
    xf = x[..., :rot].float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    if rot < x.shape[-1]:
        out = torch.cat([out, x[..., rot:]], dim=-1)
    return out


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [T], query [T, Hq, D], key [T, Hkv, D] -> new (query, key)."""
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs.chunk(2, dim=-1)
    return _rotate_ref(query, cos, sin), _rotate_ref(key, cos, sin)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_xt, stride_xh, stride_ot, stride_oh, t, n_heads, cos, sin,
                  offs, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < n_heads) & (offs[None, :] < HALF)
    xp = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs[None, :]
    op = o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(op, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(op + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


@step_jit(pointers=("pos_ptr",))
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cmask = offs < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, num_q_heads, cos, sin,
                  offs, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, num_k_heads, cos, sin,
                  offs, HALF, BLOCK_HK)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE (Triton). query [T, Hq, D], key [T, Hkv, D] (token/head
    strides free, last dim contiguous), positions int64 [T]. Returns new
    contiguous (query, key); the inputs are not modified."""
    if not (query.is_cuda or type(_rotary_kernel).__name__ == "InterpretedFunction"):
        return rotary_embedding_ref(positions, query, key, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim
    rot = cos_sin_cache.shape[-1]
    assert rot % 2 == 0 and rot <= head_dim
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    positions = positions.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if rot < head_dim:
        q_out[..., rot:] = query[..., rot:]
        k_out[..., rot:] = key[..., rot:]
    if num_tokens == 0:
        return q_out, k_out
    half = rot // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, q_out, k_out, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        num_q_heads, num_k_heads,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_k_heads),
        num_warps=4,
    )
    return q_out, k_out
