"""InternLM2 / InternLM2.5 (InternLM2ForCausalLM; remote code, not in transformers): Llama's
layer under other names, with q, k and v packed in one tensor per KV group:

    attention.wqkv  [kv_heads * (group + 2) * head_dim, hidden]: for each KV head, the `group`
                    query heads that use it, then its k head, then its v head
    attention.wo, feed_forward.w1 / w3 / w2 (gate / up / down), attention_norm, ffn_norm,
    model.tok_embeddings, output (the lm_head)

The names map onto the Llama blocks' (hf_to_loom); wqkv's loader unpacks the groups into the
q, k and v parts of our fused qkv_proj, each through the column-parallel loader, so that every
rank keeps its own query and KV heads. `bias` (False in released checkpoints) puts biases on
wqkv and wo, as in the remote code."""
from __future__ import annotations

import functools

import torch

from workers.models.blocks import DecoderForCausalLM, DecoderLayer, DecoderModel
from workers.models.layers import RotaryEmbedding, get_head_dim, get_num_kv_heads

# checkpoint name part -> ours (the Llama blocks'); w1 / w3 become gate / up, then fused (STACKED_PARAMS)
_NAMES = [("model.tok_embeddings.", "model.embed_tokens."), (".attention.wqkv.", ".self_attn.qkv_proj."),
          (".attention.wo.", ".self_attn.o_proj."), (".feed_forward.w1.", ".mlp.gate_proj."),
          (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
          (".attention_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm.")]


@torch.no_grad()
def _wqkv_loader(param: torch.nn.Parameter, loaded, shard_id=None, *, column_loader, kv_heads: int, group: int,
                 head_dim: int) -> None:
    """wqkv (or its bias) packed per KV group -> the q, k and v parts, each split over the ranks
    by the column loader. A part (shard_id "q", "k", "v": a weight update of ours) passes through."""
    if shard_id is not None:
        return column_loader(param, loaded, shard_id)
    full = loaded if isinstance(loaded, torch.Tensor) else loaded[:]   # a safetensors slice: read whole
    packed = full.view(kv_heads, group + 2, head_dim, *full.shape[1:])
    rest = full.shape[1:]
    column_loader(param, packed[:, :group].reshape(kv_heads * group * head_dim, *rest), "q")
    column_loader(param, packed[:, group].reshape(kv_heads * head_dim, *rest), "k")
    column_loader(param, packed[:, group + 1].reshape(kv_heads * head_dim, *rest), "v")


def internlm2_layer(config, rotary_emb: RotaryEmbedding, layer_idx: int) -> DecoderLayer:
    bias = bool(getattr(config, "bias", False))
    layer = DecoderLayer(config, rotary_emb, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=False)
    kv_heads = get_num_kv_heads(config)
    unpack = dict(kv_heads=kv_heads, group=config.num_attention_heads // kv_heads, head_dim=get_head_dim(config))
    qkv = layer.self_attn.qkv_proj
    for param in (qkv.weight, qkv.bias):
        if param is not None:
            param.weight_loader = functools.partial(_wqkv_loader, column_loader=param.weight_loader, **unpack)
    return layer


class InternLM2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: DecoderModel(config, internlm2_layer))

    def hf_to_loom(self, name: str) -> str | None:
        if name == "output.weight":
            return None if self.tie_word_embeddings else "lm_head.weight"
        for theirs, ours in _NAMES:
            name = name.replace(theirs, ours)
        return super().hf_to_loom(name)
