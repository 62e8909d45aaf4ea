"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (none on o_proj).

`use_sliding_window` / sliding layers are not implemented (full attention; a
warning is logged when the config enables them)."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
