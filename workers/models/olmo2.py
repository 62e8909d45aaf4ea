"""OLMo-2 (Olmo2ForCausalLM): Llama's projections and gated MLP, with the norms moved.

    h   = x + post_attention_layernorm(attention(x))
    out = h + post_feedforward_layernorm(mlp(h))

No norm before attention or the MLP; q and k are each RMS-normed over the whole projection
(all heads together, before the head split), then rotated. The layer is composed here from the
shared blocks (workers/models/blocks.py), which stay as they are: the worked example of
docs/adding_a_model.md. Biases follow `config.attention_bias` (False in released checkpoints).
The checkpoint's names are ours (HF's `model.layers.N.self_attn.q_norm.weight`, ...)."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import all_reduce, tp_rank, tp_size
from workers.models.blocks import DecoderForCausalLM, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import (KVCache, RMSNorm, RotaryEmbedding, get_num_kv_heads, heads_of_rank,
                                   layer_sliding_window)


def rms_norm_across_ranks(x: torch.Tensor, norm: RMSNorm, start: int) -> torch.Tensor:
    """RMSNorm over a whole projection of which x [T, n] holds this rank's columns, from
    `start` on. Under tensor parallelism the ranks' sums of squares are added (a KV head that
    several ranks replicate is counted on each, as every head is, so the mean stays right)."""
    if tp_size() == 1:
        return norm(x)
    xf = x.float()
    var = all_reduce(xf.pow(2).sum(-1, keepdim=True)) / (x.shape[-1] * tp_size())
    weight = norm.weight[start:start + x.shape[-1]]
    return ((xf * torch.rsqrt(var + norm.eps)).to(x.dtype).float() * weight.float()).to(x.dtype)


class Olmo2Attention(SelfAttention):
    """SelfAttention with q_norm / k_norm over the whole q / k projection instead of per head."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        bias = bool(getattr(config, "attention_bias", False))
        # o_norm_slot None: the post-norm takes o_proj's sum as a tensor, not a deferred PendingSum
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False, o_norm_slot=None,
                         sliding_window=layer_sliding_window(config, layer_idx))
        total_kv_heads = get_num_kv_heads(config)
        _, _, kv_start = heads_of_rank(config.num_attention_heads, total_kv_heads, tp_rank(), tp_size())
        self.q_start, self.k_start = tp_rank() * self.q_size, kv_start * self.head_dim
        self.q_norm = RMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(total_kv_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.split_qkv(self.qkv_proj(hidden))
        q = rms_norm_across_ranks(q, self.q_norm, self.q_start)
        k = rms_norm_across_ranks(k, self.k_norm, self.k_start)
        return self.attend(positions, q, k, v, kv_cache, meta)


class Olmo2DecoderLayer(nn.Module):
    """The post-norm block. The residual stream is carried as (hidden, residual) like the
    pre-norm layers': the output is hidden + residual, added where the next layer (or the
    model's final norm) reads it."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary_emb, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, norm_slot=None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden if residual is None else hidden + residual
        h = x + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: DecoderModel(config, Olmo2DecoderLayer))
