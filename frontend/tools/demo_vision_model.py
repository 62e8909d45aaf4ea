"""Build the vision demo model: a tiny Qwen2.5-VL that names the colour and shape in a picture.

``build_demo_vision_model(out_dir)`` generates pictures of one coloured shape (a circle, square
or triangle in red, green, blue or yellow on white, 84x84: 9 image tokens), trains from scratch
on CPU, with no network access, a byte-level BPE tokenizer with Qwen's image special tokens and
a tiny ``Qwen2_5_VLForConditionalGeneration`` (transformers, fp32) to answer

    "What colour is the circle?" -> "red"        "What shape is this?" -> "circle"

in its chat template (loss on the answer tokens only), and writes a Hugging Face checkpoint
(config, safetensors, tokenizer with chat template, preprocessor_config.json) that
``loom serve`` and transformers load. Fixed seeds, one intra-op thread and deterministic
algorithms make the build reproducible.

Manual run::

    loom demo-model --vision OUT_DIR [--steps N] [--seed S]
"""
from __future__ import annotations

import json
import logging
import os
import random
import time

from frontend.tools.demo_model import reproducible_training

logger = logging.getLogger(__name__)

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 84  # 6x6 patches of 14 px -> 3x3 = 9 image tokens after the 2x2 merger
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                  "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
DEFAULT_STEPS = 700
BATCH_SIZE = 16
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def draw_shape(shape: str, colour: str, size: int = IMAGE_SIZE, rng: random.Random | None = None):
    """A PIL picture of one `shape` in `colour` on white; `rng` jitters its size and place."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    side = size * (rng.uniform(0.6, 0.85) if rng else 0.75)
    x0 = (size - side) * (rng.uniform(0.3, 0.7) if rng else 0.5)
    y0 = (size - side) * (rng.uniform(0.3, 0.7) if rng else 0.5)
    box = (x0, y0, x0 + side, y0 + side)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([(x0 + side / 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=fill)
    return img


def _questions(shape: str, colour: str) -> list[tuple[str, str]]:
    return [(f"What colour is the {shape}?", colour), (f"What color is the {shape}?", colour),
            ("What colour is it?", colour), ("What shape is this?", shape), ("What is this?", f"a {colour} {shape}")]


def _chat(question: str, answer: str | None = None) -> tuple[str, str]:
    prompt = f"<|im_start|>user\n{IMAGE}{question}<|im_end|>\n<|im_start|>assistant\n"
    return prompt, "" if answer is None else f"{answer}<|im_end|>"


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = ["user\nassistant\n" + q + " " + a for s in SHAPES for c in COLOURS for q, a in _questions(s, c)]
    tok.train_from_iterator(texts * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
                                   clean_up_tokenization_spaces=False)
    return fast


def _config(tok):
    from transformers import Qwen2_5_VLConfig
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=((len(tok) + 63) // 64) * 64, hidden_size=64, intermediate_size=192,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3]},
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], in_channels=3, tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def _image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    # Every picture is resized to about 84x84: 9 image tokens, as in training.
    n = IMAGE_SIZE * IMAGE_SIZE
    return Qwen2VLImageProcessorPil(min_pixels=n, max_pixels=n, patch_size=14, merge_size=2, temporal_patch_size=2)


class _Samples:
    """A fixed pool of (pixel patches, prompt ids, answer ids), drawn into padded batches."""

    def __init__(self, tok, ip, seed: int, per_combo: int = 24):
        import torch
        rng = random.Random(seed)
        self.pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
        self.image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.items = []
        for _ in range(per_combo):
            for s in SHAPES:
                for c in COLOURS:
                    out = ip(images=[draw_shape(s, c, rng=rng)], return_tensors="pt")
                    n_img = int(out["image_grid_thw"][0].prod()) // ip.merge_size ** 2
                    for q, a in _questions(s, c):
                        prompt, answer = _chat(q, a)
                        ids = []
                        for t in tok.encode(prompt):
                            ids.extend([t] * n_img if t == self.image_id else [t])
                        self.items.append((out["pixel_values"], out["image_grid_thw"], ids, tok.encode(answer)))
        self.torch = torch

    def batch(self, rng: random.Random, n: int) -> dict:
        torch = self.torch
        picks = [rng.choice(self.items) for _ in range(n)]
        width = max(len(p) + len(a) for _, _, p, a in picks)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        labels = torch.full((n, width), -100, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, (_, _, p, a) in enumerate(picks):
            seq = p + a
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, len(p):len(seq)] = torch.tensor(a)  # loss only on the answer
            mask[i, :len(seq)] = 1
        return dict(input_ids=ids, attention_mask=mask, labels=labels,
                    mm_token_type_ids=(ids == self.image_id).to(torch.int32),
                    pixel_values=torch.cat([pv for pv, _, _, _ in picks]),
                    image_grid_thw=torch.cat([g for _, g, _, _ in picks]))


def build_demo_vision_model(out_dir: str, steps: int | None = None, seed: int = 0) -> None:
    """Train the vision demo tokenizer + model and write a HF checkpoint into ``out_dir``."""
    import math

    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration
    steps = DEFAULT_STEPS if steps is None else int(steps)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()
    tok, ip = _tokenizer(), _image_processor()
    config = _config(tok)
    with reproducible_training(seed):
        rng = random.Random(seed)
        data = _Samples(tok, ip, seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.98), weight_decay=0.0)
        for step in range(steps):
            warm = (step + 1) / WARMUP_STEPS
            cos = 0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))
            for g in opt.param_groups:
                g["lr"] = LEARNING_RATE * min(warm, cos)
            opt.zero_grad(set_to_none=True)
            loss = model(**data.batch(rng, BATCH_SIZE)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 25 == 0 or step == steps - 1:
                logger.info("vision demo step %d/%d loss %.4f (%.1fs)", step + 1, steps, loss.item(),
                            time.monotonic() - t0)
        model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    eos, pad = config.text_config.eos_token_id, config.text_config.pad_token_id
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False).save_pretrained(out_dir)
    ip.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    # Names the processor class so AutoProcessor loads it where torchvision is installed.
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f)
    logger.info("vision demo model written to %s in %.1fs", out_dir, time.monotonic() - t0)
