"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (none on o_proj).

Sliding layers (`use_sliding_window` from `max_window_layers` on, or `layer_types`)
come from layers.layer_sliding_window, as in every DecoderModel."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
