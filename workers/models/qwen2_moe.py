"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (qkv bias) with, on sparse layers, routed
experts plus a shared expert scaled per token by sigmoid(shared_expert_gate(x)).

A layer is sparse when it is not in `mlp_only_layers` and (index + 1) % `decoder_sparse_step`
is 0; the others keep a dense MLP of `intermediate_size`. Routing: softmax top-k, renormalised
when `norm_topk_prob`. Qwen3-MoE (workers/models/qwen3_moe.py) is this without the shared
expert, with q/k norms."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import all_reduce, tp_size
from workers.models import layers
from workers.models.blocks import DecoderForCausalLM, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import KVCache, RMSNorm, RotaryEmbedding, layer_sliding_window
from workers.models.moe import FusedMoE, Router, expert_params
from workers.models.weights import STACKED_PARAMS


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class Qwen2MoeSparseMoeBlock(nn.Module):
    """HF's names: gate (router), experts, shared_expert, shared_expert_gate."""

    def __init__(self, config):
        super().__init__()
        self.gate = Router(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob))
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = GatedMLP(config.hidden_size, shared, norm_slot=None) if shared else None
        self.shared_expert_gate = Router(config.hidden_size, 1) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return self.experts(x, self.gate(x))
        scale = torch.sigmoid(self.shared_expert_gate(x))
        if tp_size() == 1:
            return self.experts(x, self.gate(x)) + scale * self.shared_expert(x)
        # the shared expert is tensor-parallel under TP and EP alike: its partial sum (scaled per
        # token by the replicated gate) joins the experts' before the layer's one all-reduce
        shared = self.shared_expert
        partial = F.linear(layers.silu_and_mul(shared.gate_up_proj(x)), shared.down_proj.weight)
        return all_reduce(self.experts(x, self.gate(x), reduce=False) + scale * partial)


class Qwen2MoeDecoderLayer(nn.Module):
    """Pre-norm: attention, then the sparse block (or a dense MLP) after post_attention_layernorm."""
    qk_norm = False
    sparse_block = Qwen2MoeSparseMoeBlock

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int, *, qkv_bias: bool):
        super().__init__()
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=qkv_bias, o_bias=False, qk_norm=self.qk_norm,
                                       sliding_window=layer_sliding_window(config, layer_idx))
        self.sparse = is_sparse_layer(config, layer_idx)
        self.mlp = (self.sparse_block(config) if self.sparse
                    else GatedMLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        if not self.sparse:
            return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    layer_class = Qwen2MoeDecoderLayer
    qkv_bias: bool | None = True   # None: config.attention_bias
    expert_prefix = ".mlp.experts."
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config):
        qkv_bias = bool(getattr(config, "attention_bias", False)) if self.qkv_bias is None else self.qkv_bias
        super().__init__(config, lambda config: DecoderModel(
            config, lambda c, rotary, i: self.layer_class(c, rotary, i, qkv_bias=qkv_bias)))
        # the experts' per-expert checkpoint names first: ".gate_proj." would match them too
        self.stacked_params = expert_params(self.expert_prefix, config.num_experts, self.expert_names) + STACKED_PARAMS
