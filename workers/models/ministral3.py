"""Ministral 3 (Ministral3ForCausalLM, the Ministral-3 2512 text models): Mistral's layer (no
biases; YaRN rope in the released configs) with Llama 4's attention temperature: past
`original_max_position_embeddings` the queries grow with the position,

    q *= 1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))

(both read from `rope_parameters`, as HF reads them). The scale is one number per token, so it
is applied before the rotary (which it commutes with) in the fused rotary + KV-cache op.
Weight names are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.models.blocks import DecoderForCausalLM, DecoderLayer, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import KVCache, RMSNorm, RotaryEmbedding, get_rope_params, layer_sliding_window


class Ministral3Attention(SelfAttention):
    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__(config, rotary_emb, qkv_bias=False, o_bias=False, qk_norm=False,
                         sliding_window=layer_sliding_window(config, layer_idx))
        rope = get_rope_params(config)
        self.beta = rope.get("llama_4_scaling_beta")
        self.original_max = rope.get("original_max_position_embeddings")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm, kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
        q, k, v = self.split_qkv(qkv)
        if self.beta:   # HF's get_llama_4_attn_scale, in float32 then cast to q's dtype
            scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original_max))
            q = q * scale.to(q.dtype)[:, None]
        return self.attend(positions, q, k, v, kv_cache, meta), residual


class Ministral3DecoderLayer(DecoderLayer):
    """The pre-norm block (blocks.DecoderLayer's) around Ministral3Attention."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        nn.Module.__init__(self)   # DecoderLayer's forward, with this layer's own modules
        self.self_attn = Ministral3Attention(config, rotary_emb, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Ministral3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: DecoderModel(config, Ministral3DecoderLayer))
