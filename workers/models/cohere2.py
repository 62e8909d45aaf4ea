"""Cohere2 (Cohere2ForCausalLM, Command R7B / Command A): Cohere (cohere.py: the parallel block,
LayerNorm without bias, GPT-J rotary, logit_scale, tied lm_head) with local and global layers
interleaved (`layer_types`, `sliding_window`). As in HF, only the sliding-window layers rotate q
and k; the global layers attend without positions (NoPE). Weight names are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.models.cohere import CohereDecoderLayer, CohereForCausalLM, CohereModel
from workers.models.layers import get_head_dim, layer_sliding_window


class NoRotary(nn.Module):
    """A rotary embedding that does not rotate: cos 1 and sin 0 at every position, so the fused
    rotary + KV-cache op (layers.qk_norm_rope_cache) passes q and k through unchanged (x * 1 + y * 0
    is x exactly)."""
    mrope_section = None
    is_neox_style = True

    def __init__(self, head_size: int, max_position: int):
        super().__init__()
        half = (max_position, head_size // 2)
        cache = torch.cat([torch.ones(half, dtype=torch.float32), torch.zeros(half, dtype=torch.float32)], -1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)


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
