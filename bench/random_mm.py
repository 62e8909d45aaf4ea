"""vLLM's `random-mm` dataset for `loom bench serve`: chat requests of random text plus random
images. Each request carries --random-mm-base-items-per-request images (varied by
--random-mm-num-mm-items-range-ratio, capped by --random-mm-limit-mm-per-prompt), each of a
size drawn from --random-mm-bucket-config {(height, width, frames): probability} (frames 1:
images; video buckets are not supported). Images are random RGB JPEGs sent as data URLs,
made before the clock starts. Each text is --random-input-len tokens long, as vLLM's: random ids
decode to text that re-encodes to another count (rare ids of a large vocabulary: ~6x as many),
so the text is re-encoded and cut or padded until it holds that many (texts_of_length)."""
from __future__ import annotations

import ast
import base64
import io
import json
import math
import random
import re

DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"


def add_args(p) -> None:
    p.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                   help="random-mm: images per request (default: %(default)s)")
    p.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="random-mm: images per request vary uniformly in base * [1 - r, 1 + r] (default: %(default)s)")
    p.add_argument("--random-mm-limit-mm-per-prompt", default='{"image": 255}',
                   help="random-mm: JSON cap per modality (default: %(default)s)")
    p.add_argument("--random-mm-bucket-config", default=DEFAULT_BUCKETS,
                   help="random-mm: {(height, width, frames): probability} (default: %(default)s)")


def _buckets(text: str) -> list[tuple[tuple[int, int], float]]:
    try:
        cfg = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SystemExit(f"--random-mm-bucket-config is not a dict literal: {text!r}") from None
    out = []
    for (h, w, t), prob in cfg.items():
        if t != 1 and prob > 0:
            raise SystemExit("--random-mm-bucket-config: only image buckets (frames = 1) are supported")
        if prob > 0:
            out.append(((int(h), int(w)), float(prob)))
    if not out:
        raise SystemExit("--random-mm-bucket-config has no bucket with a positive probability")
    return out


def _jpeg_url(rng: random.Random, h: int, w: int) -> str:
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


SPECIAL = re.compile(r"<\|[^|<>]*\|>")   # random ids may decode to special tokens (image pads)
MAX_ROUNDS = 10   # vLLM's gen_prompt_decode_to_target_len: max_retry


async def texts_of_length(call, prompts: list[list[int]]) -> list[str]:
    """Each prompt's random ids as a text that the server's tokenizer encodes to as many tokens
    (vLLM's gen_prompt_decode_to_target_len): decode, re-encode, cut or pad, for at most
    MAX_ROUNDS rounds (then the last text, a token or so off).
    call(path, payload) -> the JSON answer of one of the server's /tokenize and /detokenize."""
    out = []
    for ids in prompts:
        target, cur = len(ids), list(ids)
        rng = random.Random(target)
        for _ in range(MAX_ROUNDS):
            text = SPECIAL.sub("", (await call("/detokenize", {"tokens": cur}))["prompt"])
            cur = (await call("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]
            if len(cur) == target:
                break
            # too long: cut to one short, then pad with the re-encoded text's own tokens, drawn anew each
            # round (cutting alone can end on the same broken character every round)
            keep = min(len(cur), target - 1)
            cur = cur[:keep] + rng.choices(cur or ids, k=target - keep)   # (or ids: a text that was all special tokens)
        out.append(text)
    return out


def make_requests(args, texts: list[str]) -> list[list[dict]]:
    """One user message (content parts: the images, then the text) per prompt text."""
    rng = random.Random(args.seed)
    buckets = _buckets(args.random_mm_bucket_config)
    limit = json.loads(args.random_mm_limit_mm_per_prompt).get("image", 255)
    base, r = args.random_mm_base_items_per_request, args.random_mm_num_mm_items_range_ratio
    lo, hi = max(0, math.floor(base * (1 - r))), min(limit, math.ceil(base * (1 + r)))
    sizes, weights = zip(*buckets)
    messages = []
    for text in texts:
        k = rng.randint(lo, max(lo, hi))
        parts = [{"type": "image_url", "image_url": {"url": _jpeg_url(rng, *rng.choices(sizes, weights)[0])}}
                 for _ in range(k)]
        messages.append([{"role": "user", "content": parts + [{"type": "text", "text": text}]}])
    return messages
