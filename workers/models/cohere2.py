"""Cohere2 (Cohere2ForCausalLM, Command R7B / Command A): Cohere (cohere.py: the parallel block,
LayerNorm without bias, GPT-J rotary, logit_scale, tied lm_head) with local and global layers
interleaved (`layer_types`, `sliding_window`). As in HF, only the sliding-window layers rotate q
and k; the global layers attend without positions (NoPE). Weight names are HF's."""
from __future__ import annotations


from workers.models.cohere import CohereDecoderLayer, CohereForCausalLM, CohereModel
from workers.models.layers import NoRotary, get_head_dim, layer_sliding_window


class Cohere2Model(CohereModel):
    def __init__(self, config):
        nope = NoRotary(get_head_dim(config), config.max_position_embeddings)

        def make_layer(config, rotary_emb, i):
            local = layer_sliding_window(config, i) is not None
            return CohereDecoderLayer(config, rotary_emb if local else nope, i)

        super().__init__(config, make_layer)
        self.no_rotary = nope


class Cohere2ForCausalLM(CohereForCausalLM):
    model_class = Cohere2Model
