"""StableLM (StableLmForCausalLM: StableLM-3B-4E1T, StableLM 2): Llama's projections and SwiGLU
MLP with LayerNorms (with bias) instead of RMSNorms, partial rotary (`partial_rotary_factor`,
0.25), q/k/v biases (`use_qkv_bias`), optionally the parallel block (`use_parallel_residual`:
x + attention(n) + mlp(n) with one norm) and per-head q/k LayerNorms (`qk_layernorm`, one
checkpoint tensor per head: `q_layernorm.norms.{h}.weight`). Weight names are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import tp_rank, tp_size
from workers.models.blocks import DecoderForCausalLM, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import (KVCache, LayerNorm, PerHeadLayerNorm, RotaryEmbedding, get_num_kv_heads,
                                   heads_of_rank, layer_sliding_window)
from workers.models.weights import STACKED_PARAMS


class StableLmAttention(SelfAttention):
    """SelfAttention on an already-normed input, with the optional per-head q/k LayerNorms."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__(config, rotary_emb, qkv_bias=bool(config.use_qkv_bias), o_bias=False, qk_norm=False,
                         o_norm_slot=None, sliding_window=layer_sliding_window(config, layer_idx))
        self.qk_layernorm = bool(config.qk_layernorm)
        if self.qk_layernorm:
            total_kv = get_num_kv_heads(config)
            _, _, kv_start = heads_of_rank(config.num_attention_heads, total_kv, tp_rank(), tp_size())
            eps = config.layer_norm_eps
            self.q_layernorm = PerHeadLayerNorm(config.num_attention_heads, tp_rank() * self.num_heads,
                                                self.num_heads, self.head_dim, eps, per_head_tensors=True)
            self.k_layernorm = PerHeadLayerNorm(total_kv, kv_start, self.num_kv_heads, self.head_dim, eps,
                                                per_head_tensors=True)

    def forward(self, positions: torch.Tensor, normed: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.split_qkv(self.qkv_proj(normed))
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        return self.attend(positions, q, k, v, kv_cache, meta)


class StableLmDecoderLayer(nn.Module):
    """Pre-norm (attention, then the MLP after post_attention_layernorm), or the parallel block."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = StableLmAttention(config, rotary_emb, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, norm_slot=None)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.use_parallel_residual = bool(config.use_parallel_residual)
        if not self.use_parallel_residual:
            self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attn = self.self_attn(positions, normed, kv_cache, meta)
        if self.use_parallel_residual:
            return attn + self.mlp(normed), residual
        normed, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(normed), residual


class StableLmForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: DecoderModel(
            config, StableLmDecoderLayer, lambda c: LayerNorm(c.hidden_size, c.layer_norm_eps)))
        # the per-head q/k norms' checkpoint tensors are rows (shard id: the head) of our [heads, head_dim] weights
        heads = {"q_layernorm": config.num_attention_heads, "k_layernorm": get_num_kv_heads(config)}
        self.stacked_params = STACKED_PARAMS + [(f".{n}.weight", f".{n}.norms.{h}.weight", h)
                                                for n, count in heads.items() for h in range(count)]
