"""GLM (GlmForCausalLM, glm-4-9b-chat-hf): Llama's pre-norm layer with

* biases on q, k and v (`attention_bias`, True in the checkpoints), none on o_proj;
* partial rotary (`partial_rotary_factor`, 0.5: the first half of each head turns) in GPT-J
  style: HF's rotate_half pairs neighbours (x[0::2], x[1::2]); the cos/sin cache is the same;
* gate and up already fused in the checkpoint as `mlp.gate_up_proj` (gate first), the name of
  our fused parameter: the whole tensor goes to the column-parallel loader with no shard id,
  which splits it by the parts' sizes and keeps this rank's rows of gate and of up
  (layers._column_loader), so tensor parallelism needs nothing here.

GLM-4-0414 (glm4.py) adds sandwich norms. Weight names are HF's."""
from __future__ import annotations

from workers.models.blocks import DecoderForCausalLM, DecoderLayer, DecoderModel
from workers.models.layers import RotaryEmbedding


class GlmModel(DecoderModel):
    """DecoderModel with GPT-J style (interleaved) rotary."""

    def __init__(self, config, make_layer):
        super().__init__(config, make_layer)
        self.rotary_emb.is_neox_style = False   # the one instance all layers share


def glm_layer(config, rotary_emb: RotaryEmbedding, layer_idx: int) -> DecoderLayer:
    return DecoderLayer(config, rotary_emb, layer_idx, qkv_bias=bool(getattr(config, "attention_bias", True)),
                        o_bias=False, qk_norm=False, mlp_bias=False)


class GlmForCausalLM(DecoderForCausalLM):
    make_layer = staticmethod(glm_layer)

    def __init__(self, config):
        super().__init__(config, lambda config: GlmModel(config, self.make_layer))
