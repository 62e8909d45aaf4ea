"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k RMSNorm, bias per
`attention_bias`) with routed experts and no shared expert; `norm_topk_prob`,
`decoder_sparse_step` and `mlp_only_layers` as in Qwen2-MoE (workers/models/qwen2_moe.py)."""
from __future__ import annotations

from workers.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock


class Qwen3MoeSparseMoeBlock(Qwen2MoeSparseMoeBlock):
    """Qwen3-MoE's config has no shared expert (shared_expert_intermediate_size absent)."""


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    qk_norm = True
    sparse_block = Qwen3MoeSparseMoeBlock


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    qkv_bias = None
