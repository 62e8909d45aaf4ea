"""Gemma (GemmaForCausalLM): Llama's pre-norm layer with Gemma's three twists, which Gemma 2 and 3
(gemma2.py, gemma3.py) keep:

* RMSNorm scales by (1 + w), in float32 (layers.GemmaRMSNorm stores 1 + w at load);
* the token embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype as HF
  does (GemmaModel);
* the MLP is GeGLU, gelu with the tanh approximation (`hidden_act`, or `hidden_activation` in
  Gemma 2/3: HF's "gelu_pytorch_tanh"; transformers maps Gemma 1's legacy "gelu" to it).

The lm_head is tied to the embedding in the released checkpoints. Weight names are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.models.blocks import DecoderForCausalLM, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import GemmaRMSNorm, KVCache, RotaryEmbedding, layer_sliding_window

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")  # HF's names of the tanh approximation


def gemma_act(config) -> str:
    """GatedMLP's activation for a Gemma config (Gemma 2/3 name it `hidden_activation`)."""
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    if act not in _GELU_TANH:
        raise ValueError(f"{type(config).__name__}: activation {act!r} is not supported (gelu tanh: {_GELU_TANH})")
    return "gelu_tanh"


class GemmaModel(DecoderModel):
    """DecoderModel with the embedding scaled by sqrt(hidden_size) and a Gemma final norm."""

    def __init__(self, config, make_layer):
        super().__init__(config, make_layer, lambda c: GemmaRMSNorm(c.hidden_size, c.rms_norm_eps))
        # HF keeps the normalizer as a float32 buffer and casts it to the embedding's dtype
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            embeds = self.embed_tokens(input_ids)
            inputs_embeds = embeds * self.embed_scale.to(embeds.dtype)
        return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds)


class GemmaDecoderLayer(nn.Module):
    """The pre-norm block (as blocks.DecoderLayer) with Gemma norms and GeGLU."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False,
                                       sliding_window=layer_sliding_window(config, layer_idx))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=gemma_act(config))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)


class GemmaForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, lambda config: GemmaModel(config, GemmaDecoderLayer))
