"""Ernie 4.5 (Ernie4_5ForCausalLM, the dense ERNIE-4.5-0.3B): Llama's layer with GPT-J style
(interleaved) rotary over the whole head, as GLM's (glm.GlmModel), and `use_bias` on every
projection (q, k, v, o and the MLP's). The lm_head is tied to the embedding in the released
checkpoint. Weight names are HF's."""
from __future__ import annotations

from workers.models.blocks import DecoderForCausalLM, DecoderLayer
from workers.models.glm import GlmModel
from workers.models.layers import RotaryEmbedding


def ernie_layer(config, rotary_emb: RotaryEmbedding, layer_idx: int) -> DecoderLayer:
    bias = bool(getattr(config, "use_bias", False))
    return DecoderLayer(config, rotary_emb, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=bias)


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: GlmModel(config, ernie_layer))
