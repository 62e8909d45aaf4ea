"""What the speech-language models (Qwen2-Audio, Voxtral) share: an audio tower and a projector
beside a text model under `language_model`, HF's checkpoint names for them, the memory profiling's
longest clip, and the weight loading that sends the text model's weights to its own loader."""
from __future__ import annotations


import numpy as np

from workers.models.wrapped_lm import WrappedLanguageModel

# HF's names (transformers >= 4.5x) -> ours
RENAMES = [("model.audio_tower.", "audio_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
           ("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")]


class AudioLanguageModel(WrappedLanguageModel):
    tower = "audio_tower"

    """The weight loading and the memory profiling's longest clip of a model with
    `audio_tower` (None: language_model_only), `multi_modal_projector`, `language_model` and
    `hf_config` (its audio_config: num_mel_bins, max_source_positions)."""

    def dummy_image(self, num_tokens: int) -> dict[str, np.ndarray]:
        """Processed arrays of the longest clip (memory profiling)."""
        ac = self.hf_config.audio_config
        frames = 2 * ac.max_source_positions
        return {"input_features": np.zeros((1, ac.num_mel_bins, frames), np.float32),
                "feature_attention_mask": np.ones((1, frames), np.int32)}

    def hf_to_loom(self, name: str) -> str:
        for old, new in RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        # some transformers releases nest a whole *ForCausalLM under `model.language_model`, so its
        # decoder's names carry one `model.` more (model.language_model.model.layers...)
        if name.startswith("language_model.model.model."):
            name = "language_model.model." + name[len("language_model.model.model."):]
        elif name.startswith("language_model.model.lm_head."):
            name = "language_model." + name[len("language_model.model."):]
        return name
