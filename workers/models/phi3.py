"""Phi-3 (Phi3ForCausalLM; Phi-3.5, Phi-4 and Phi-4-mini share it): Llama's layer, with the
checkpoint's q/k/v and gate/up already fused, under the names of our fused parameters
(`qkv_proj`, `gate_up_proj`, gate before up). A whole fused tensor goes to the column-parallel
loader with no shard id, which splits it by the parts' sizes and keeps this rank's rows of each
(layers._column_loader), so tensor parallelism needs nothing here.

Partial rotary (`partial_rotary_factor`, Phi-4-mini) and LongRoPE scaling (`rope_parameters`,
the 128k checkpoints) come with the rotary embedding; `sliding_window` (Phi-3-mini-4k) applies
to every layer."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False
    stacked_params = []   # no separate q/k/v or gate/up tensors in the checkpoint
