"""A multimodal model that wraps a text model under `language_model` (LLaVA, Qwen2-Audio,
Voxtral): its forward, input embeddings and logits are the text model's."""
from __future__ import annotations

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard
from workers.models.layers import KVCache


class WrappedLanguageModel(nn.Module):
    """The model contract's text half, delegated to `self.language_model` (a *ForCausalLM)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        return self.language_model.compute_logits(hidden, plain)
