"""Layers shared by the decoder-only architectures (Llama, Mistral, Qwen2, Qwen3).

Every hot op goes through one module-level name (`rms_norm`,
`fused_add_rms_norm`, `qk_norm_rope_cache`, `silu_and_mul`): the plain-torch
reference from kernels/ by default, rebound to the Triton kernel by
use_triton_kernels(). The layers look the name up at run time, so nothing else
changes.

Parameters are created with `torch.empty` (no init): the model is built under
`torch.device(...)` and a default dtype by `workers.model_loader`, and then every
parameter is filled by the weight loader (or with dummy values).
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul_ref
from kernels.qk_rope_cache import qk_norm_rope_cache_ref
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import build_rope_cache

from workers.attention import Attention, AttentionMetadata

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- ops
# The torch references in kernels/ (HF's numerics); use_triton_kernels() rebinds them.
rms_norm = rms_norm_ref
fused_add_rms_norm = fused_add_rms_norm_ref
qk_norm_rope_cache = qk_norm_rope_cache_ref  # per-head q/k norm, rotary, then the KV-cache write
silu_and_mul = silu_and_mul_ref


# ------------------------------------------------------------------ config helpers
def use_triton_kernels() -> None:
    """The GPU path: route the ops above through the Triton kernels in kernels/."""
    from kernels import activation, qk_rope_cache
    from kernels import rms_norm as triton_norm

    globals().update(rms_norm=triton_norm.rms_norm, fused_add_rms_norm=triton_norm.fused_add_rms_norm,
                     silu_and_mul=activation.silu_and_mul, qk_norm_rope_cache=qk_rope_cache.qk_norm_rope_cache)


def get_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def get_rope_params(config) -> dict:
    """The rope parameters as one flat dict with at least `rope_theta` and
    `rope_type`, from either layout:

    * transformers 5: `config.rope_parameters = {"rope_theta": ..., "rope_type": ..., ...}`
      (possibly keyed per layer type; we take "full_attention");
    * older configs: `config.rope_theta` plus `config.rope_scaling` (None, or a
      dict with "rope_type" or the older "type")."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    out: dict = {}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        out.update(scaling)
    if isinstance(params, dict):
        out.update(params)
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    rope_type = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = rope_type
    if getattr(config, "partial_rotary_factor", None) is not None and "partial_rotary_factor" not in out:
        out["partial_rotary_factor"] = config.partial_rotary_factor
    return out


# ------------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: the normalized x. With residual: x + residual is
        normalized and (out, new_residual) returned."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Positions-based rotary embedding over a precomputed float32 cos/sin cache
    of `max_position` rows. One instance is shared by all layers of a model.

    rope_type: "default", "linear" or "llama3" (as HF's
    `_compute_llama3_parameters`). Other types raise NotImplementedError."""

    def __init__(self, head_size: int, max_position: int, rope_params: dict):
        super().__init__()
        self.head_size = head_size
        factor = rope_params.get("partial_rotary_factor", 1.0) or 1.0
        self.rotary_dim = int(head_size * factor)
        self.rope_params = dict(rope_params)
        self.rope_type = rope_params["rope_type"]
        # Built on the CPU (as HF computes inv_freq at init), then moved with the model.
        cache = build_rope_cache(self.rotary_dim, max_position, float(rope_params["rope_theta"]), rope_params)
        self.register_buffer("cos_sin_cache", cache, persistent=False)



class Linear(nn.Module):
    """y = x W^T (+ b), parameters left uninitialized."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linear layers with the same input stacked along the output dim
    (qkv_proj = [q; k; v], gate_up_proj = [gate; up]). `shards` names each
    slice in order; the weight loader copies checkpoint tensors into them."""

    def __init__(self, in_features: int, shards: dict, bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_ranges: dict = {}
        offset = 0
        for name, size in shards.items():
            self.shard_ranges[name] = (offset, size)
            offset += size


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SelfAttention(nn.Module):
    """qkv projection -> [per-head q/k RMSNorm] -> rotary, KV-cache write -> paged attention -> o_proj."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = get_num_kv_heads(config)
        self.head_dim = get_head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size,
                                     {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # shared instance
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = qk_norm_rope_cache(positions, q, k, v, self.rotary_emb.cos_sin_cache, *kv_cache, meta.slot_mapping,
                               *norms)
        return self.o_proj(self.attn(q, kv_cache, meta))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried between layers so the
    add can be fused into the next norm."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, mlp_bias: bool):
        super().__init__()
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# ---------------------------------------------------------------- weight loading
def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         stacked_mapping: list[tuple[str, str, object]],
                         ignore: callable = lambda name: False, partial: bool = False) -> set[str]:
    """Copy checkpoint tensors into the model's parameters, in place (param.data is
    never replaced, so captured CUDA graphs stay valid).

    stacked_mapping: (our_fused_name, checkpoint_name, shard_id) substring
    rewrites, e.g. (".qkv_proj.", ".q_proj.", "q"). Raises ValueError on a
    duplicate checkpoint name, a shape mismatch, checkpoint weights that map to
    nothing, or (unless `partial`: a weight update of some tensors) parameters
    (or shards of fused ones) left unloaded. Returns the set of checkpoint names loaded."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if ckpt_name in seen:
            raise ValueError(f"weight {ckpt_name!r} appears twice in the checkpoint")
        seen.add(ckpt_name)
        if ignore(ckpt_name):
            continue
        name, shard_id = ckpt_name, None
        for fused, part, sid in stacked_mapping:
            if part in ckpt_name:
                name, shard_id = ckpt_name.replace(part, fused), sid
                break
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        target = param.data
        if shard_id is not None:
            module = model.get_submodule(name.rsplit(".", 1)[0])
            offset, size = module.shard_ranges[shard_id]
            target = target.narrow(0, offset, size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {ckpt_name!r}: checkpoint shape {tuple(tensor.shape)} "
                             f"!= expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.setdefault(name, set()).add(shard_id)

    missing = []
    for name in params if not partial else ():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        expected = set(module.shard_ranges) if isinstance(module, MergedLinear) else {None}
        got = loaded.get(name, set())
        missing += [name if s is None else f"{name}[{s}]" for s in expected if s not in got]
    if unexpected or missing:
        msg = []
        if unexpected:
            msg.append(f"checkpoint weights with no matching parameter: {_short(unexpected)}")
        if missing:
            msg.append(f"parameters not loaded from the checkpoint: {_short(missing)}")
        raise ValueError(f"{type(model).__name__}: " + "; ".join(msg))
    return seen


def _short(names: list[str], n: int = 10) -> str:
    more = f" ... (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(sorted(names)[:n]) + more
