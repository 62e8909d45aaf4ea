"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k before rotary.

Biases follow `config.attention_bias` (False in released checkpoints), on q,
k, v and o alike, as in HF."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
