"""SmolLM3 (SmolLM3ForCausalLM): Llama with NoPE layers. `no_rope_layers[i]` (1: rotate, 0: not;
by default every `no_rope_layer_interval`-th layer skips rotary) says which layers turn q and k;
the others attend without positions. The lm_head is tied to the embedding in the released
checkpoints. Biases follow `attention_bias` / `mlp_bias`; names are HF's."""
from __future__ import annotations


from workers.models.blocks import DecoderForCausalLM, DecoderLayer, DecoderModel
from workers.models.layers import NoRotary, RotaryEmbedding, get_head_dim


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
