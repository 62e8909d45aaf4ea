"""GLM-4 (Glm4ForCausalLM, GLM-4-0414 and GLM-Z1): GLM (glm.py: q/k/v biases, partial GPT-J
rotary, the checkpoint's fused gate_up_proj) with sandwich norms, each branch normed after too:

    h   = x + post_self_attn_layernorm(attention(input_layernorm(x)))
    out = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

Weight names are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.models.blocks import GatedMLP, SelfAttention
from workers.models.glm import GlmForCausalLM
from workers.models.layers import KVCache, RMSNorm, RotaryEmbedding, layer_sliding_window


class Glm4DecoderLayer(nn.Module):
    """The sandwich block. o_proj's and down_proj's sums come back as tensors (norm_slot None):
    a post-norm takes them without a residual."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=bool(getattr(config, "attention_bias", True)),
                                       o_bias=False, qk_norm=False, o_norm_slot=None,
                                       sliding_window=layer_sliding_window(config, layer_idx))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, norm_slot=None)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        mlp, residual = self.mlp.forward_normed(self.post_self_attn_layernorm(attn), residual,
                                                self.post_attention_layernorm)
        return self.post_mlp_layernorm(mlp), residual


class Glm4ForCausalLM(GlmForCausalLM):
    make_layer = Glm4DecoderLayer
