"""Mixtral (MixtralForCausalLM): Mistral's attention with, on every layer, `num_local_experts`
routed experts (softmax top-k, always renormalised) under HF's `block_sparse_moe` and its
per-expert names w1 (gate), w3 (up), w2 (down)."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.models.blocks import DecoderForCausalLM, DecoderModel, SelfAttention
from workers.models.layers import KVCache, RMSNorm, RotaryEmbedding, layer_sliding_window
from workers.models.moe import FusedMoE, Router, expert_params
from workers.models.weights import STACKED_PARAMS


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Router(config.hidden_size, config.num_local_experts)
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=False, o_bias=False, qk_norm=False,
                                       sliding_window=layer_sliding_window(config, layer_idx))
        self.block_sparse_moe = MixtralSparseMoeBlock(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_sparse_moe(normed), residual


class MixtralForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: DecoderModel(config, MixtralDecoderLayer))
        self.stacked_params = (expert_params(".block_sparse_moe.experts.", config.num_local_experts, ("w1", "w3", "w2"))
                               + STACKED_PARAMS)
