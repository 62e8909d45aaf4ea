"""SmolLM3 (SmolLM3ForCausalLM): Llama with NoPE layers. `no_rope_layers[i]` (1: rotate, 0: not;
by default every `no_rope_layer_interval`-th layer skips rotary) says which layers turn q and k;
the others attend without positions. The lm_head is tied to the embedding in the released
checkpoints. Biases follow `attention_bias` / `mlp_bias`; names are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.models.blocks import DecoderForCausalLM, DecoderLayer, DecoderModel
from workers.models.layers import RotaryEmbedding, get_head_dim


class NoRotary(nn.Module):
    """A rotary embedding that does not rotate: cos 1 and sin 0 at every position, so the fused
    rotary + KV-cache op (layers.qk_norm_rope_cache) passes q and k through unchanged
    (x * 1 + y * 0 is x exactly). (h44-archa's cohere2.py has the same for Cohere2's global layers.)"""
    mrope_section = None
    is_neox_style = True

    def __init__(self, head_size: int, max_position: int):
        super().__init__()
        half = (max_position, head_size // 2)
        cache = torch.cat([torch.ones(half, dtype=torch.float32), torch.zeros(half, dtype=torch.float32)], -1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)


class SmolLM3Model(DecoderModel):
    def __init__(self, config):
        nope = NoRotary(get_head_dim(config), config.max_position_embeddings)
        bias = dict(qkv_bias=bool(getattr(config, "attention_bias", False)),
                    o_bias=bool(getattr(config, "attention_bias", False)),
                    qk_norm=False, mlp_bias=bool(getattr(config, "mlp_bias", False)))

        def make_layer(config, rotary_emb: RotaryEmbedding, i: int) -> DecoderLayer:
            return DecoderLayer(config, rotary_emb if config.no_rope_layers[i] else nope, i, **bias)

        super().__init__(config, make_layer)
        self.no_rotary = nope


class SmolLM3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, SmolLM3Model)
