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
    processor settings. An audio model's info is multimodal/audio_info.py's AudioInfo: the
    items differ (loading, hashing, the HF processor), the path through the store does not."""

    modality = "image"   # what this model's items are (MultiModalItem.modality, --limit-mm-per-prompt's key)

    # mm_processor_kwargs a request may send: only settings that bound an image's size (any other
    # setting, a patch size or a normalisation, would change what the vision encoder receives)
    accepted_kwargs: tuple[str, ...] = ()

    # prompts of at most this many tokens are scheduled one token per step beside other requests
    # (EngineConfig.stepwise_prompt_tokens; 0: in chunks as large as the budget allows)
    stepwise_prompt_tokens = 0

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

    # -------------------------------------------------------- the items (images by default)

    def prepare(self, obj, model_dir: str):
        """An offline input (a PIL image, or bytes of one) -> the item the processor takes."""
        from multimodal.media import as_image
        return as_image(obj)

    async def load_url(self, url: str, allowed_dir: str | None, off_loop, model_dir: str):
        """A content part's URL -> the item (decoded off the event loop)."""
        from multimodal.media import load_image_url
        return await load_image_url(url, allowed_dir, off_loop)

    def content_bytes(self, item) -> tuple[str, bytes]:
        """(its shape, its content) of an item, for its hash."""
        return f"{item.mode}:{item.size}", item.tobytes()

    def load_processor(self, model_dir: str, trust_remote_code: bool):
        from transformers import AutoImageProcessor
        return AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)

    def run_processor(self, processor, item, call_kwargs: dict):
        return processor(images=[item], return_tensors="np", **call_kwargs)
