"""Helium (HeliumForCausalLM, Kyutai Helium-1): Llama's layer with GPT-J style (interleaved)
rotary over the whole head, as GLM's (glm.GlmModel); q/k/v biases follow `attention_bias`, none
on o_proj; `mlp_bias`. (HF's RMSNorm multiplies by the weight before the cast to the model's
dtype, ours after: the same in float32, a rounding apart in bf16.) Weight names are HF's."""
from __future__ import annotations

from workers.models.blocks import DecoderForCausalLM, DecoderLayer
from workers.models.glm import GlmModel
from workers.models.layers import RotaryEmbedding


def helium_layer(config, rotary_emb: RotaryEmbedding, layer_idx: int) -> DecoderLayer:
    return DecoderLayer(config, rotary_emb, layer_idx, qkv_bias=bool(getattr(config, "attention_bias", False)),
                        o_bias=False, qk_norm=False, mlp_bias=bool(getattr(config, "mlp_bias", False)))


class HeliumForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: GlmModel(config, helium_layer))
