"""Gemma 3, text only (Gemma3ForCausalLM, config Gemma3TextConfig): Gemma 2 (gemma2.py) with

* per-head q/k norms (Gemma's 1 + w), before the rotary;
* the local (sliding-window) layers rotating with their own rope parameters:
  `rope_parameters["sliding_attention"]` in transformers 5, `rope_local_base_freq` in older
  configs; the global layers' may scale (linear, in the larger checkpoints);
* no soft-capping in the released configs (both caps are honoured when set).

Weight names are HF's."""
from __future__ import annotations

from workers.models.gemma import GemmaModel
from workers.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from workers.models.layers import RotaryEmbedding, get_head_dim, get_rope_params


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    qk_norm = True


class Gemma3Model(GemmaModel):
    """GemmaModel whose sliding-window layers use the local rotary embedding (self.rotary_emb_local)."""

    def __init__(self, config, layer_class):
        local = RotaryEmbedding(get_head_dim(config), config.max_position_embeddings,
                                get_rope_params(config, "sliding_attention"))

        def make_layer(config, rotary_emb, i):
            sliding = config.layer_types[i] == "sliding_attention"
            return layer_class(config, local if sliding else rotary_emb, i)

        super().__init__(config, make_layer)
        self.rotary_emb_local = local


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer

    def make_model(self, config) -> GemmaModel:
        return Gemma3Model(config, self.layer_class)
