"""MultiModalInfo: what a vision-language model declares about its images, for the processor
(multimodal/processor.py, in the frontend's processes) and the config resolution (in the entry
points). A model file subclasses it and sets an instance as its class attribute `multimodal`
(workers/models/qwen2_5_vl.py, workers/models/llava.py); the frontend gets it through
workers.models.registry.multimodal_info and hands it down, so nothing here imports workers/.

Every method reads the checkpoint's JSON (`hf`: its config.json as a dict), never torch."""
from __future__ import annotations

import json
import os

import numpy as np


def preprocessor_config(model_dir: str) -> dict:
    """The checkpoint's preprocessor_config.json ({} when it has none)."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


class MultiModalInfo:
    """The image rules of one architecture. Defaults: a fixed-size image input, no per-request
    processor settings."""

    # mm_processor_kwargs a request may send: only settings that bound an image's size (any other
    # setting, a patch size or a normalisation, would change what the vision encoder receives)
    accepted_kwargs: tuple[str, ...] = ()

    def image_token_id(self, hf: dict) -> int:
        """The placeholder token that each image's tokens replace in the prompt."""
        raise NotImplementedError

    def max_item_tokens(self, model_dir: str, hf: dict) -> int:
        """Placeholder tokens of the largest image the processor can produce (sizes the engine's
        per-step encoder budget)."""
        raise NotImplementedError

    def max_pixels(self, model_dir: str, hf: dict) -> int:
        """The largest image in pixels that mm_processor_kwargs may ask for (0: no such setting)."""
        return 0

    def call_kwargs(self, kwargs: dict, image_processor) -> dict:
        """Checked mm_processor_kwargs -> the image processor call's keyword arguments."""
        return dict(kwargs)

    def arrays(self, out) -> dict[str, np.ndarray]:
        """The processor's output -> the arrays the model's encode_images takes."""
        return {"pixel_values": np.ascontiguousarray(out["pixel_values"], dtype=np.float32)}

    def placeholder_tokens(self, hf: dict, arrays: dict[str, np.ndarray]) -> int | None:
        """The placeholder tokens of one image's arrays, or None when the arrays do not have the
        shapes the vision encoder (per its config.json, not the processor's defaults) takes."""
        raise NotImplementedError
