"""Rotary position embedding: the cos/sin cache of every HF rope type, and the torch reference.

cos_sin_cache is float32 [max_position, rot_dim]: the first rot_dim // 2
columns are cos, the rest sin, over the rot_dim // 2 frequencies, both already
multiplied by the rope type's attention factor (YaRN's mscale, LongRoPE's
scaling) as HF multiplies its cos and sin. rot_dim is normally head_dim; a
smaller rot_dim rotates only the first rot_dim dims of each head (partial
rotary) and passes the rest through.

NeoX style (Llama, Qwen) rotates the halves x = [x1 | x2] of the rotary dims:
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
GPT-J style (GLM, Cohere) the interleaved pairs (x[2i], x[2i+1]) the same way.
Computed in fp32 and rounded once to the input dtype. The GPU path rotates in
kernels/qk_rope_cache.py, fused with the per-head norm and the cache write.

Rope types (the math of transformers.modeling_rope_utils, one function each
below, tested against HF's rotary modules): default, linear, dynamic, yarn,
longrope, llama3. HF recomputes dynamic-NTK and LongRoPE frequencies per forward
from the sequence length; the engine serves one fixed cache, so (as vLLM) the
choice is made once from `max_position`, the longest context the cache serves:
  * longrope: the long factors when max_position > original_max_position_embeddings,
    else the short ones (HF's choice for any sequence that long);
  * dynamic: the NTK base of a sequence of max_position tokens when max_position
    exceeds the config's max_position_embeddings (as vLLM: one fixed base for the
    longest context served, so shorter sequences differ from HF there), else the
    default frequencies, which is what HF uses for every sequence within it.
"""
from __future__ import annotations

import math

import torch


def _exponents(dim: int) -> torch.Tensor:
    # arange(0, dim, 2) / dim, as transformers builds it (int64, then float)
    return torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    # Same expression as transformers' default rope init.
    return 1.0 / (base ** _exponents(dim))


# Each rope type: (rotary dims, base, params, max_position) -> (inv_freq [dim // 2], attention factor).
# params is the flat dict of workers.models.layers.get_rope_params; "max_position_embeddings"
# in it is the config's (HF's reference length for dynamic and the factor fallbacks).

def _default(dim: int, base: float, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    return _inv_freq(dim, base), 1.0


def _linear(dim: int, base: float, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    # _compute_linear_scaling_rope_parameters: positions / factor, i.e. inv_freq / factor
    return _inv_freq(dim, base) / p["factor"], 1.0


def _dynamic(dim: int, base: float, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    # _compute_dynamic_ntk_parameters at seq_len = max_position (HF: the current sequence length,
    # never below max_position_embeddings, where the base is unchanged).
    factor = p["factor"]
    ref = p.get("max_position_embeddings") or max_position
    seq_len = max(max_position, ref)
    base = base * ((factor * seq_len / ref) - (factor - 1)) ** (dim / (dim - 2))
    return _inv_freq(dim, base), 1.0


def _original_max(p: dict, max_position: int) -> int:
    return p.get("original_max_position_embeddings") or p.get("max_position_embeddings") or max_position


def _factor_or_ratio(p: dict, max_position: int) -> float:
    # DeepSeek-V3 / Phi-3 configs may leave out `factor`: the ratio of the two context lengths
    factor = p.get("factor")
    if factor is None:
        factor = (p.get("max_position_embeddings") or max_position) / _original_max(p, max_position)
    return factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    # _compute_yarn_parameters: interpolate the low frequencies by `factor`, keep the high ones,
    # a linear ramp between (beta_fast, beta_slow rotations over the original context).
    factor = _factor_or_ratio(p, max_position)
    original = _original_max(p, max_position)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _longrope(dim: int, base: float, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    # _compute_longrope_parameters, with the long factors iff the cache serves past the original context
    original = _original_max(p, max_position)
    factor = _factor_or_ratio(p, max_position)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = p["long_factor"] if max_position > original else p["short_factor"]
    ext_factors = torch.tensor(ext, dtype=torch.float32)
    assert ext_factors.shape == (dim // 2,), f"longrope factors: {len(ext)} given, {dim // 2} rotary frequencies"
    return 1.0 / (ext_factors * base ** _exponents(dim)), attention_factor


def _llama3(dim: int, base: float, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    # _compute_llama3_parameters: low frequencies / factor, high ones kept, smoothed between
    inv_freq = _inv_freq(dim, base)
    factor = p["factor"]
    low_freq_factor = p["low_freq_factor"]
    high_freq_factor = p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0


ROPE_TYPES = {"default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn,
              "longrope": _longrope, "llama3": _llama3}
# Older config spellings: "mrope" (Qwen2-VL: default frequencies, three position rows), "su"
# (early Phi-3 LongRoPE).
_ALIASES = {"mrope": "default", "su": "longrope"}


def rope_type_of(rope_scaling: dict | None) -> str:
    """The rope type named by a rope-parameters dict ("rope_type", or the older "type"); a
    ValueError names the supported ones for any other."""
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default")) or "default"
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return rope_type


def build_rope_cache(head_dim: int, max_position: int, base: float, rope_scaling: dict | None,
                     device=None) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos of the head_dim // 2 frequencies, then sin, times
    the type's attention factor. head_dim is the rotary dims (head_dim * partial_rotary_factor).

    rope_scaling: None or the rope parameters (get_rope_params' flat dict, or a config's
    rope_scaling): "rope_type" (or "type") and that type's keys, as transformers reads them.
    max_position: the rows of the cache, the longest context it serves (it picks LongRoPE's
    factors and the dynamic-NTK base, see the module docstring)."""
    p = dict(rope_scaling or {})
    fn = ROPE_TYPES[rope_type_of(p)]
    inv_freq, attention_factor = fn(head_dim, base, p, max_position)  # on the CPU, as HF at init
    t = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq.to(t.device).float())  # same products as HF's inv_freq @ position_ids
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat([cos, sin], dim=-1).contiguous()


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
