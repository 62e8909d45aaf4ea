"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (none on o_proj).

Sliding layers (`use_sliding_window`) are not implemented: the engine caps
--max-model-len at the window, where full attention is the same."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
