"""Chat messages with OpenAI content parts -> the prompt text (the model's chat template puts
one image placeholder per image part) and the images, in order."""
from __future__ import annotations

from multimodal.media import MediaError, as_image, load_data_url, load_file_url


def split_parts(messages: list[dict]) -> tuple[list[dict], list]:
    """Messages for the chat template (image parts become {"type": "image"}) and the image
    sources in order: URLs (str) of image_url parts, or PIL images."""
    out, sources = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                sources.append(url)
                parts.append({"type": "image"})
            elif kind == "image_pil":
                sources.append(part.get("image_pil"))
                parts.append({"type": "image"})
            else:
                raise MediaError(f"content parts of type {kind!r} are not supported")
        out.append({**m, "content": parts})
    return out, sources


def render_chat(tokenizer, messages: list[dict], allowed_dir: str | None) -> tuple[str, list]:
    """Offline: the prompt text and the loaded images (data: and file: URLs, PIL images)."""
    msgs, sources = split_parts(messages)
    images = []
    for src in sources:
        if isinstance(src, str):
            images.append(load_data_url(src) if src.startswith("data:") else load_file_url(src, allowed_dir))
        else:
            images.append(as_image(src))
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text, images
