"""HyperCLOVA X (HyperCLOVAXForCausalLM, HyperCLOVAX-SEED-Think): Granite's multipliers
(granite.py: embedding, attention and residual multipliers) with Peri-LN, a norm after each
branch as well (`use_post_norm`: post_norm1 after attention, post_norm2 after the MLP, before the
residual multiplier), and the logits multiplied (not divided) by `logits_scaling`. Weight names
are HF's."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard
from workers.models.granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel, map_logits
from workers.models.layers import KVCache, RMSNorm, RotaryEmbedding


class HyperCLOVAXDecoderLayer(GraniteDecoderLayer):
    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__(config, rotary_emb, layer_idx)
        post = bool(getattr(config, "use_post_norm", True))
        self.post_norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps) if post else nn.Identity()
        self.post_norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps) if post else nn.Identity()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.residual_multiplier
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        hidden, residual = self.mlp.forward_normed(self.post_norm1(hidden) * m, residual,
                                                   self.post_attention_layernorm)
        return self.post_norm2(hidden) * m, residual


class HyperCLOVAXModel(GraniteModel):
    def __init__(self, config):
        super().__init__(config, HyperCLOVAXDecoderLayer)


class HyperCLOVAXForCausalLM(GraniteForCausalLM):
    model_class = HyperCLOVAXModel

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        """The lm_head's logits times logits_scaling (as HF)."""
        logits = self.lm_head.logits(hidden, plain)
        return logits if self.logits_scaling == 1 else map_logits(logits, lambda x: x * self.logits_scaling)
