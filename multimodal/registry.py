"""What the engine needs to know about a vision-language checkpoint, from its JSON files
alone (no transformers import in the engine core): the largest image's placeholder count."""
from __future__ import annotations

import json
import os

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
LLAVA_TYPES = ("llava",)


def _preprocessor(model_dir: str) -> dict:
    path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def max_item_tokens(model_dir: str, hf: dict) -> int:
    """Placeholder tokens of the largest image the model's processor can produce; 0 for a
    text-only model. Sizes the engine's per-step encoder budget."""
    model_type = hf.get("model_type")
    if model_type in QWEN_VL_TYPES:
        pp = _preprocessor(model_dir)
        unit = int(pp.get("patch_size", 14)) * int(pp.get("merge_size", 2))
        return max_pixels(model_dir, hf) // (unit * unit)
    if model_type in LLAVA_TYPES:
        return llava_image_tokens(hf)
    return 0


def max_pixels(model_dir: str, hf: dict) -> int:
    """A Qwen-VL processor's largest image in pixels (its own max_pixels); 0 for other models."""
    if hf.get("model_type") not in QWEN_VL_TYPES:
        return 0
    pp = _preprocessor(model_dir)
    return int(pp.get("max_pixels") or (pp.get("size") or {}).get("longest_edge") or 12845056)


def llava_image_tokens(hf: dict) -> int:
    """The tower's tokens (CLIP: a class token + the patches; SigLIP: the patches), less the
    first under the "default" select strategy (as HF's LLaVA crops it)."""
    vc = hf.get("vision_config") or {}
    n = (int(vc.get("image_size", 336)) // int(vc.get("patch_size", 14))) ** 2
    if vc.get("model_type", "clip_vision_model") != "siglip_vision_model":
        n += 1
    if hf.get("vision_feature_select_strategy", "default") == "default":
        n -= 1
    return n
