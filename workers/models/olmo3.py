"""OLMo-3 (Olmo3ForCausalLM): OLMo-2's layer (olmo2.py: post-norms, q/k norms over the whole
projection) with sliding-window layers (`layer_types`: by default three in four) that take
their own rope parameters (`rope_parameters["sliding_attention"]`; a YaRN `rope_scaling`
applies to the full-attention layers only). Weight names are HF's."""
from __future__ import annotations

from workers.models.blocks import DecoderForCausalLM, DecoderModel
from workers.models.layers import RotaryEmbedding, get_head_dim
from workers.models.olmo2 import Olmo2DecoderLayer


def _sliding_rope_params(config) -> dict:
    params = dict(config.rope_parameters["sliding_attention"])
    params.setdefault("rope_type", "default")
    return params


class Olmo3Model(DecoderModel):
    """DecoderModel whose sliding layers turn q and k by their own rotary embedding."""

    def __init__(self, config):
        local = RotaryEmbedding(get_head_dim(config), config.max_position_embeddings, _sliding_rope_params(config))

        def make_layer(config, rotary_emb: RotaryEmbedding, i: int) -> Olmo2DecoderLayer:
            sliding = config.layer_types[i] == "sliding_attention"
            return Olmo2DecoderLayer(config, local if sliding else rotary_emb, i)

        super().__init__(config, make_layer)
        self.local_rotary_emb = local


class Olmo3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, Olmo3Model)
