"""CWM (CwmForCausalLM, Meta's Code World Model): Llama (no biases, llama3 rope scaling) with
sliding-window and full-attention layers interleaved by `layer_types` (layers.layer_sliding_window
reads them). Weight names are HF's."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class CwmForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False
