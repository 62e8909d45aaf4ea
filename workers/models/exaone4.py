"""EXAONE 4.0 (Exaone4ForCausalLM): OLMo-2's post-norm layer (olmo2.py),

    h   = x + post_attention_layernorm(attention(x))
    out = h + post_feedforward_layernorm(mlp(h))

with a per-head RMSNorm on q and k (Qwen3's, before rotary) and, in the hybrid checkpoints
(`sliding_window` set), local layers (`layer_types`) that rotate q and k while the global ones
attend without positions (NoPE, smollm3.NoRotary). No biases. Weight names are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.models.blocks import DecoderForCausalLM, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import KVCache, NoRotary, RMSNorm, RotaryEmbedding, get_head_dim, layer_sliding_window


class Exaone4DecoderLayer(nn.Module):
    """The post-norm block; like Olmo2DecoderLayer, its output hidden + residual is added where
    the next layer (or the final norm) reads it."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        # o_norm_slot None: the post-norm takes o_proj's sum as a tensor, not a deferred PendingSum
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=False, o_bias=False, qk_norm=True,
                                       o_norm_slot=None, sliding_window=layer_sliding_window(config, layer_idx))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, norm_slot=None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden if residual is None else hidden + residual
        attn = self.self_attn
        h = x + self.post_attention_layernorm(attn.attend(positions, *attn.split_qkv(attn.qkv_proj(x)), kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Exaone4Model(DecoderModel):
    def __init__(self, config):
        nope = NoRotary(get_head_dim(config), config.max_position_embeddings)

        def make_layer(config, rotary_emb: RotaryEmbedding, i: int) -> Exaone4DecoderLayer:
            rotates = config.sliding_window is None or config.layer_types[i] == "sliding_attention"
            return Exaone4DecoderLayer(config, rotary_emb if rotates else nope, i)

        super().__init__(config, make_layer)
        self.no_rotary = nope


class Exaone4ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, Exaone4Model)
