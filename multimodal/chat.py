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


def check_conversation(messages) -> None:
    """ValueError unless `messages` is a list of {"role", "content"} messages (content a string,
    None, or a list of content parts): an offline caller's mistake, named."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("a conversation must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a 'role' string, got {type(m).__name__}")
        content = m.get("content")
        if not (content is None or isinstance(content, str)
                or (isinstance(content, list) and all(isinstance(p, dict) for p in content))):
            raise ValueError(f"message {i}: content must be a string, None or a list of content parts")


def render_chat(tokenizer, messages: list[dict], allowed_dir: str | None, **template) -> tuple[str, list]:
    """Offline: the prompt text and the loaded images (data: and file: URLs, PIL images).
    `template`: apply_chat_template's keywords (frontend.openai.protocol.template_options)."""
    check_conversation(messages)
    msgs, sources = split_parts(messages)
    images = []
    for src in sources:
        if isinstance(src, str):
            images.append(load_data_url(src) if src.startswith("data:") else load_file_url(src, allowed_dir))
        else:
            images.append(as_image(src))
    text = tokenizer.apply_chat_template(msgs, tokenize=False, **template)
    return text, images
