"""Ministral (MinistralForCausalLM, Ministral-8B-Instruct-2410): Mistral's layer (no biases) with
sliding-window and full-attention layers interleaved by `layer_types` (layers.layer_sliding_window
reads them). Weight names are HF's."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class MinistralForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False
