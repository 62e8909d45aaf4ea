"""Granite (GraniteForCausalLM, IBM Granite 3.x): Llama with four scalars from the config,

    embedding_multiplier   the token embeddings are multiplied by it
    attention_multiplier   the attention score scale (instead of head_dim ** -0.5)
    residual_multiplier    each block's output (attention, then MLP) is multiplied by it before
                           it joins the residual stream
    logits_scaling         the logits are divided by it

With our residual convention (a layer returns (hidden, residual), its output hidden + residual,
the add fused into the next norm) the residual multiplier scales `hidden` only. The scaled
outputs are plain tensors (o_proj / down_proj norm_slot None: a deferred TP sum cannot be
scaled before the norm adds it). Biases follow `attention_bias` / `mlp_bias`; names are HF's."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard
from workers.models.blocks import DecoderForCausalLM, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import KVCache, RMSNorm, RotaryEmbedding, layer_sliding_window


class GraniteDecoderLayer(nn.Module):
    """The pre-norm block with each branch's output times residual_multiplier."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False,
                                       o_norm_slot=None, sliding_window=layer_sliding_window(config, layer_idx),
                                       scale=config.attention_multiplier)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                            norm_slot=None)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        hidden, residual = self.mlp.forward_normed(hidden * self.residual_multiplier, residual,
                                                   self.post_attention_layernorm)
        return hidden * self.residual_multiplier, residual


class GraniteModel(DecoderModel):
    """DecoderModel with the token embeddings times embedding_multiplier."""

    def __init__(self, config, make_layer=GraniteDecoderLayer):
        super().__init__(config, make_layer)
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embedding_multiplier
        return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds)


def map_logits(logits: torch.Tensor | LogitsShard, fn) -> torch.Tensor | LogitsShard:
    """fn applied to the logits, or to a rank's LogitsShard's columns (fn acts on each logit alone)."""
    if isinstance(logits, LogitsShard):
        return dataclasses.replace(logits, logits=fn(logits.logits))
    return fn(logits)


class GraniteForCausalLM(DecoderForCausalLM):
    model_class = GraniteModel

    def __init__(self, config):
        super().__init__(config, self.model_class)
        self.logits_scaling = config.logits_scaling

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        """The lm_head's logits divided by logits_scaling (as HF, after the product)."""
        logits = super().compute_logits(hidden, plain)
        return logits if self.logits_scaling == 1 else map_logits(logits, lambda x: x / self.logits_scaling)
