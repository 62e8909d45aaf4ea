"""Gemma 2 (Gemma2ForCausalLM): Gemma (gemma.py: 1 + w norms, scaled embedding, GeGLU) with

* sandwich norms: each sublayer's output is normed before it joins the residual stream,
      h   = x + post_attention_layernorm(attention(input_layernorm(x)))
      out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)));
* attention scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped,
  cap * tanh(scores / cap) (`attn_logit_softcapping`);
* local and global layers interleaved (`layer_types`, `sliding_window`);
* the final logits soft-capped likewise (`final_logit_softcapping`).

Weight names are HF's; the lm_head is tied to the embedding in the released checkpoints."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard
from workers.models.blocks import DecoderForCausalLM, GatedMLP, SelfAttention
from workers.models.gemma import GemmaModel, gemma_act
from workers.models.layers import GemmaRMSNorm, KVCache, RotaryEmbedding, layer_sliding_window


class Gemma2DecoderLayer(nn.Module):
    """The sandwich-norm block. The post-norms take o_proj's and down_proj's sums as tensors
    (norm_slot None: a deferred PendingSum is fused only with a residual add, which they have not)."""
    qk_norm = False   # Gemma 3: per-head q/k norms

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm,
                                       o_norm_slot=None, sliding_window=layer_sliding_window(config, layer_idx),
                                       logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
                                       scale=config.query_pre_attn_scalar ** -0.5)
        if self.qk_norm:   # Gemma norms over each head (SelfAttention builds plain RMSNorms)
            self.self_attn.q_norm = GemmaRMSNorm(self.self_attn.head_dim, config.rms_norm_eps)
            self.self_attn.k_norm = GemmaRMSNorm(self.self_attn.head_dim, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, norm_slot=None, act=gemma_act(config))
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        mlp, residual = self.mlp.forward_normed(self.post_attention_layernorm(attn), residual,
                                                self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(mlp), residual


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_class = Gemma2DecoderLayer

    def __init__(self, config):
        super().__init__(config, self.make_model)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def make_model(self, config) -> GemmaModel:
        return GemmaModel(config, self.layer_class)

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        """The lm_head's logits, soft-capped as HF does (in the model's dtype). Capped logits are
        always gathered whole (never a LogitsShard), so the sampler's sharded path never sees
        uncapped values."""
        cap = self.final_logit_softcapping
        if cap is None:
            return super().compute_logits(hidden, plain)
        logits = super().compute_logits(hidden, plain=False)
        return torch.tanh(logits / cap) * cap
