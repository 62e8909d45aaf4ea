"""The model contract: what the engine may ask of a model class (vLLM's interfaces.py, as
small protocols). The engine asks the model; it never branches on `model_type`.

Every model (TextModel):
    __init__(config)                       built under the target device and dtype, params empty
    forward(input_ids, positions, kv_caches, meta) -> hidden [T, hidden]
    compute_logits(hidden, plain=False) -> logits (or this rank's LogitsShard)
    load_weights(weights, partial=False) -> names loaded (workers/models/weights.py)
    stacked_params                          the checkpoint parts of fused parameters
    hf_to_loom(name) -> our name or None    the weight-name mapping (None: not loaded)

A model that takes images also declares SupportsMultiModal (its `multimodal` class attribute is
the MultiModalInfo the frontend's processor and the config resolution ask), and one whose
rotary takes three position rows SupportsMRoPE."""
from __future__ import annotations

from typing import ClassVar, Iterable, Protocol, runtime_checkable

import numpy as np
import torch

from multimodal.info import MultiModalInfo


@runtime_checkable
class TextModel(Protocol):
    stacked_params: ClassVar[list[tuple[str, str, object]]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False): ...

    def hf_to_loom(self, name: str) -> str | None: ...

    def load_weights(self, weights: Iterable[tuple[str, object]], partial: bool = False) -> set[str]: ...


class SupportsMultiModal(Protocol):
    """Built with language_model_only=True it has no vision tower (--language-model-only)."""
    multimodal: ClassVar[MultiModalInfo]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def encode_images(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Processed arrays (as multimodal.arrays() keeps them) -> embeddings [tokens, hidden] each."""

    def dummy_image(self, num_tokens: int) -> dict[str, np.ndarray]:
        """Processed arrays of an image of about num_tokens placeholders (memory profiling)."""


class SupportsMRoPE(Protocol):
    uses_mrope: ClassVar[bool]

    def mrope_positions(self, prompt_ids: np.ndarray, items: list) -> tuple[np.ndarray, int]: ...


def supports_multimodal(model: object) -> bool:
    """A model class (or instance) that declares its images."""
    return getattr(model, "multimodal", None) is not None
