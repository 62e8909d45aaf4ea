"""Tiny random vision-language checkpoints (Qwen2.5-VL, LLaVA) that AutoConfig, AutoProcessor
and the HF model classes load, for parity tests. No torchvision: the processors are built
from the PIL image processor and the tokenizer."""
from __future__ import annotations

import os

import torch

from tests.tiny_models import make_tokenizer

VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QWEN_VL_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _scale_weights(model, seed: int) -> None:
    # Random init is small; scale up so greedy continuations are not all the same token.
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed_tokens" in name else 0.2)


def make_tiny_qwen2_5_vl(out_dir: str, seed: int = 0, rope_theta: float = 100.0,
                         max_pixels: int = 28 * 28 * 64) -> str:
    """Qwen2.5-VL with a 2-layer ViT (one windowed block, one full), rope_theta ~100 so that
    every M-RoPE section turns visibly, and a processor AutoProcessor loads."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir)
    tok.add_special_tokens({"additional_special_tokens": QWEN_VL_SPECIAL})
    tok.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL}
    text = dict(vocab_size=len(tok) + 16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                                                    "mrope_section": [2, 3, 3]},
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None)
    # (76: the tower pads its MLP width to a multiple of 64; the parity tests check that changes nothing)
    vision = dict(depth=2, hidden_size=32, intermediate_size=76, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], in_channels=3, tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _scale_weights(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=max_pixels, patch_size=14,
                                               merge_size=2, temporal_patch_size=2)
    _save_processor(out_dir, image_processor, tok, Qwen2_5_VLProcessor)
    return out_dir


def _save_processor(out_dir: str, image_processor, tok, processor_cls) -> None:
    """preprocessor_config.json, the tokenizer (with its chat template) and a processor_config.json
    naming the processor class, so that AutoProcessor loads it where torchvision is installed
    (without it transformers 5 cannot even construct the processor: it looks up the video
    processor's base class)."""
    import json
    image_processor.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": processor_cls.__name__}, f)


# ---------------------------------------------------------------- HF oracle
def hf_vl_model(model_dir: str):
    from transformers import AutoModelForImageTextToText
    return _cached_hf(model_dir, AutoModelForImageTextToText)


_HF: dict = {}


def _cached_hf(model_dir: str, cls):
    if model_dir not in _HF:
        _HF[model_dir] = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF[model_dir]


def hf_qwen_vl_greedy(model_dir: str, prompt: str, images: list, max_new_tokens: int,
                      mm_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids with the image tokens expanded, HF's greedy continuation): the processor's
    rule (grid t*h*w / merge^2 image tokens per image) applied with its image processor and
    tokenizer, then Qwen2_5_VLForConditionalGeneration.generate."""
    from transformers import AutoImageProcessor, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    ip = AutoImageProcessor.from_pretrained(model_dir)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = tok.encode(prompt)
    kwargs, mm_kwargs = {}, dict(mm_kwargs or {})
    if "min_pixels" in mm_kwargs or "max_pixels" in mm_kwargs:  # transformers 5 takes the bounds as size
        mm_kwargs["size"] = {"shortest_edge": mm_kwargs.pop("min_pixels", ip.size["shortest_edge"]),
                             "longest_edge": mm_kwargs.pop("max_pixels", ip.size["longest_edge"])}
    if images:
        out = ip(images=images, return_tensors="pt", **mm_kwargs)
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        counts = [int(g.prod()) // ip.merge_size ** 2 for g in out["image_grid_thw"]]
        expanded = []
        for t in ids:
            expanded.extend([pad] * counts.pop(0) if t == pad else [t])
        ids = expanded
    types = torch.tensor([[1 if t == pad else 0 for t in ids]], dtype=torch.int32)
    model = hf_vl_model(model_dir)
    with torch.no_grad():
        g = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           mm_token_type_ids=types, max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0, **kwargs)
    return ids, g[0, len(ids):].tolist()


def random_image(seed: int, w: int, h: int):
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def make_tiny_llava(out_dir: str, seed: int = 0, tower: str = "clip", vision_feature_layer=-2,
                    select_strategy: str = "default") -> str:
    """LLaVA: a tiny CLIP (or SigLIP) tower, a 2-layer MLP projector and a Llama language model,
    with the PIL image processor (CLIP's, or SigLIP's) and an <image> token."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, SiglipVisionConfig)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>\n")
    image_id = tok.convert_tokens_to_ids("<image>")
    text = LlamaConfig(vocab_size=len(tok) + 16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                       pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None)
    vkw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=56,
               patch_size=14)
    vision = CLIPVisionConfig(**vkw, projection_dim=32) if tower == "clip" else SiglipVisionConfig(**vkw)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                         vision_feature_layer=vision_feature_layer, vision_feature_select_strategy=select_strategy,
                         image_seq_length=16 + (tower == "clip") - (select_strategy == "default"),
                         tie_word_embeddings=False)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    _scale_weights(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tower == "clip":
        ip = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    else:
        ip = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    _save_processor(out_dir, ip, tok, LlavaProcessor)
    return out_dir


def hf_llava_greedy(model_dir: str, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids with each <image> expanded to the model's image tokens, HF's greedy continuation)."""
    import json
    from transformers import AutoImageProcessor, AutoTokenizer
    from workers.models.llava import LlavaImages
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        n = LlavaImages.image_tokens(json.load(f))
    image_id = tok.convert_tokens_to_ids("<image>")
    ids = []
    for t in tok.encode(prompt):
        ids.extend([image_id] * n if t == image_id else [t])
    kwargs = {}
    if images:
        kwargs["pixel_values"] = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")["pixel_values"]
    model = hf_vl_model(model_dir)
    with torch.no_grad():
        g = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                           eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), **kwargs)
    return ids, g[0, len(ids):].tolist()
