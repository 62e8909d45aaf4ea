"""A multimodal model that wraps a text model under `language_model` (LLaVA, Qwen2-Audio,
Voxtral): its forward, input embeddings and logits are the text model's, and its checkpoint
splits into the text model's weights and the encoder's (tower and projector)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard
from workers.models.layers import KVCache


class WrappedLanguageModel(nn.Module):
    """The model contract's text half, delegated to `self.language_model` (a *ForCausalLM), and the
    weight loading. A subclass names its encoder's attribute (`tower`, None: language_model_only)
    and maps checkpoint names to its own (hf_to_loom)."""
    tower: str   # "vision_tower", "audio_tower"

    def hf_to_loom(self, name: str) -> str:
        return name

    def unused_weight(self, name: str) -> bool:
        """A checkpoint weight of the encoder that no parameter takes, on purpose."""
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        return self.language_model.compute_logits(hidden, plain)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> set[str]:
        """`partial`: only some weights (a weight update), none required. The language model's
        weights go to its own load_weights; the encoder's and the projector's load here."""
        params = dict(self.named_parameters())
        encoder = (f"{self.tower}.", "multi_modal_projector.")
        text_weights, seen = [], set()
        for name, t in ((self.hf_to_loom(n), t) for n, t in weights):
            if name in seen:
                raise ValueError(f"weight {name!r} appears twice in the checkpoint")
            seen.add(name)
            if name.startswith("language_model."):
                text_weights.append((name[len("language_model."):], t))
            elif name.startswith(encoder):
                if name in params:
                    try:
                        params[name].weight_loader(params[name], t)
                    except ValueError as e:
                        raise ValueError(f"weight {name!r}: {e}") from None
                elif getattr(self, self.tower) is not None and not self.unused_weight(name):
                    raise ValueError(f"checkpoint weight {name!r} has no matching parameter")
        missing = [n for n in params if not n.startswith("language_model.") and n not in seen]
        if missing and not partial:
            raise ValueError(f"parameters not loaded from the checkpoint: {missing[:10]}")
        return seen | self.language_model.load_weights(iter(text_weights), partial)
