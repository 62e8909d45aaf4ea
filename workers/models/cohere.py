"""Cohere (CohereForCausalLM, Command R / R+): a parallel block with one LayerNorm,

    n   = input_layernorm(x)              (LayerNorm without bias, in float32)
    out = x + attention(n) + mlp(n)

with GPT-J (interleaved) rotary, optional per-head LayerNorms on q and k (`use_qk_norm`, one
weight row per head), the logits multiplied by `logit_scale`, and the lm_head tied to the
embedding. Cohere2 (cohere2.py) keeps all of it. Weight names are HF's."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard, tp_rank, tp_size
from workers.models.blocks import DecoderForCausalLM, DecoderModel, GatedMLP, SelfAttention
from workers.models.layers import (KVCache, LayerNorm, PerHeadLayerNorm, RotaryEmbedding, get_num_kv_heads,
                                   heads_of_rank, layer_sliding_window)


class CohereAttention(SelfAttention):
    """SelfAttention on an already-normed input, with Cohere's optional per-head q/k LayerNorms."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        bias = bool(getattr(config, "attention_bias", False))
        # o_norm_slot None: the attention output is added to the MLP's, not consumed by a norm
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False, o_norm_slot=None,
                         sliding_window=layer_sliding_window(config, layer_idx))
        self.use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        if self.use_qk_norm:
            total_kv = get_num_kv_heads(config)
            _, _, kv_start = heads_of_rank(config.num_attention_heads, total_kv, tp_rank(), tp_size())
            eps = config.layer_norm_eps
            self.q_norm = PerHeadLayerNorm(config.num_attention_heads, tp_rank() * self.num_heads, self.num_heads,
                                           self.head_dim, eps)
            self.k_norm = PerHeadLayerNorm(total_kv, kv_start, self.num_kv_heads, self.head_dim, eps)

    def forward(self, positions: torch.Tensor, normed: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.split_qkv(self.qkv_proj(normed))
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attend(positions, q, k, v, kv_cache, meta)


class CohereDecoderLayer(nn.Module):
    """The parallel block. Its output, attention + MLP, joins the residual where the next layer
    (or the final norm) reads it."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = CohereAttention(config, rotary_emb, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, norm_slot=None)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(positions, normed, kv_cache, meta) + self.mlp(normed), residual


class CohereModel(DecoderModel):
    """DecoderModel with GPT-J style rotary and a LayerNorm (no bias) as the final norm."""

    def __init__(self, config, make_layer=CohereDecoderLayer):
        super().__init__(config, make_layer, lambda c: LayerNorm(c.hidden_size, c.layer_norm_eps, bias=False))
        # HF Cohere's rotate_half pairs neighbours (x[0::2], x[1::2]); the cos/sin cache is the same
        self.rotary_emb.is_neox_style = False


class CohereForCausalLM(DecoderForCausalLM):
    model_class = CohereModel

    def __init__(self, config):
        super().__init__(config, self.model_class)
        self.logit_scale = getattr(config, "logit_scale", None)

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        """The lm_head's logits times logit_scale (in the model's dtype, as HF). A rank's
        LogitsShard is scaled as it is: the scale applies to each logit alone."""
        logits = super().compute_logits(hidden, plain)
        if self.logit_scale is None or self.logit_scale == 1:
            return logits
        if isinstance(logits, LogitsShard):
            return dataclasses.replace(logits, logits=logits.logits * self.logit_scale)
        return logits * self.logit_scale
