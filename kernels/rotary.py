"""Rotary position embedding (NeoX / rotate_half style, as HF Llama and Qwen).

cos_sin_cache is float32 [max_position, rot_dim]: the first rot_dim // 2
columns are cos, the rest sin, over the rot_dim // 2 frequencies. rot_dim is
normally head_dim; a smaller rot_dim rotates only the first rot_dim dims of
each head (partial rotary) and passes the rest through.

For a head x = [x1 | x2] (halves of rot_dim):
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
computed in fp32 and rounded once to the input dtype. The GPU path rotates in
kernels/qk_rope_cache.py, fused with the per-head norm and the cache write.
"""
from __future__ import annotations

import math

import torch


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
    if rope_type == "mrope":  # old Qwen2-VL configs: default frequencies, three position rows
        rope_type = "default"
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


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True) -> torch.Tensor:
    """NeoX style rotates the halves [x1 | x2] of the rotary dims; GPT-J style (GLM, Cohere)
    rotates the interleaved pairs (x[2i], x[2i+1]), frequency i turning pair i."""
    half = cos.shape[-1]
    rot = 2 * half
    xf = x[..., :rot].float()
    c, s = cos[:, None, :], sin[:, None, :]
    if is_neox_style:
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)
    if rot < x.shape[-1]:
        out = torch.cat([out, x[..., rot:]], dim=-1)
    return out


def mrope_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  mrope_section: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rot/2] per token. positions [T], or [3, T] for M-RoPE (Qwen2-VL family):
    frequency j then turns with the position row of its section (mrope_section splits the
    rot/2 frequencies into temporal, height, width), as HF's apply_multimodal_rotary_pos_emb."""
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs.chunk(2, dim=-1)
    if positions.dim() == 2:
        sections = list(mrope_section)
        cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(sections, dim=-1))], dim=-1)
        sin = torch.cat([c[i % 3] for i, c in enumerate(sin.split(sections, dim=-1))], dim=-1)
    return cos, sin


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor, mrope_section: tuple[int, ...] | None = None,
                         is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [T] (or [3, T] with mrope_section), query [T, Hq, D], key [T, Hkv, D]
    -> new (query, key)."""
    cos, sin = mrope_cos_sin(positions, cos_sin_cache, mrope_section)
    return _rotate_ref(query, cos, sin, is_neox_style), _rotate_ref(key, cos, sin, is_neox_style)
