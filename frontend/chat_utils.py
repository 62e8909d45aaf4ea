"""Chat messages, for every caller that has them: the API server (/v1/chat/completions,
/tokenize), its tokenizer process, and the offline `LLM.chat`.

One parser (`parse_chat_messages`) turns OpenAI chat messages into what a chat template gets:
roles checked, content parts (text, input_text, image_url, and offline image_pil) as a string or
as parts (vLLM's chat_template_content_format), an assistant's tool calls with their arguments as
objects. One `render_chat` applies the template and tokenizes its text. So a conversation is the
same token ids over HTTP and offline (tests/test_chat_parity.py). vLLM: entrypoints/chat_utils.py.

A caller's mistake is a RequestError (ipc/validation.py) naming the parameter: a ValueError to the
offline caller, a 400 over HTTP (frontend/openai/serving.py's value_error)."""
from __future__ import annotations

import json
from typing import Any

from frontend.processing import encode_bounded
from ipc.validation import RequestError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _bad(message: str) -> RequestError:
    return RequestError(message, "messages")


# ------------------------------------------------------------------ parsing

def parse_chat_messages(messages: Any, content_format: str = "string") -> list[dict]:
    """Chat messages as the template gets them. Text content parts are handed over as parts
    ([{"type": "text", "text": ...}]) when the template iterates over them ("openai"), else
    joined with newlines ("string"): vLLM's chat_template_content_format. With images always
    the parts, in order: the template puts an image placeholder at each image part."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages")
    return [_parse_message(m, i, content_format) for i, m in enumerate(messages)]


def _parse_message(m: Any, i: int, content_format: str) -> dict:
    if not isinstance(m, dict):
        raise _bad(f"messages[{i}] must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _bad(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
    content = m.get("content")
    if isinstance(content, list):
        content = _parse_parts(content, i, content_format)
    elif content is None:
        if role != "assistant":   # (an assistant's turn may be tool calls alone)
            raise _bad(f"messages[{i}].content is required for role {role!r}")
    elif not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string or a list of text parts")
    msg = dict(m)
    msg["content"] = content if content is not None else ""
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise _bad(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
        msg["tool_calls"] = _template_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
    if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise _bad(f"messages[{i}].tool_call_id must be a string")
    return msg


def _parse_parts(content: list, i: int, content_format: str) -> str | list[dict]:
    texts, parts = [], []
    for part in content:
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url":
            parts.append({"type": "image", "image_url": _image_url(part, i)})
            continue
        if kind in ("input_audio", "audio_url"):   # both as an audio URL (input_audio: a data: URL)
            parts.append({"type": "audio", "audio_url": _audio_url(part, kind, i)})
            continue
        if kind == "image_pil":   # offline only: JSON cannot carry a PIL image
            parts.append({"type": "image", "image_pil": _image_pil(part, i)})
            continue
        if kind not in ("text", "input_text"):
            raise _bad(f"messages[{i}].content: content parts of type {kind!r} are not supported "
                       "(only 'text', 'image_url', 'input_audio' and 'audio_url')")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"messages[{i}].content: a text part needs a string 'text'")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    return parts if content_format == "openai" or len(parts) > len(texts) else "\n".join(texts)


def _image_url(part: dict, i: int) -> str:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise _bad(f"messages[{i}].content: an image_url part needs image_url.url (a string)")
    return url


def _audio_url(part: dict, kind: str, i: int) -> str:
    from multimodal.audio import input_audio_url
    from multimodal.media import MediaError
    if kind == "input_audio":
        body = part.get("input_audio")
        if not isinstance(body, dict):
            raise _bad(f"messages[{i}].content: an input_audio part needs input_audio.data and input_audio.format")
        try:
            return input_audio_url(body.get("data"), body.get("format"))
        except MediaError as e:
            raise _bad(f"messages[{i}].content: {e}") from None
    url = part.get("audio_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise _bad(f"messages[{i}].content: an audio_url part needs audio_url.url (a string)")
    return url


def _image_pil(part: dict, i: int):
    from PIL import Image
    image = part.get("image_pil")
    if not isinstance(image, (Image.Image, bytes, bytearray)):
        raise _bad(f"messages[{i}].content: an image_pil part needs a PIL image (offline LLM.chat only)")
    return image


def _template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls, checked, with arguments as objects: chat templates
    (Qwen's, Llama's) write them out with tojson (vLLM parses them the same way)."""
    if not isinstance(calls, list):
        raise _bad(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _bad(f"{at} must be an object with 'id', 'type' and 'function'")
        if call.get("type", "function") != "function":
            raise _bad(f"{at}.type must be 'function', got {call.get('type')!r}")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{at}.function must be an object with a non-empty string 'name'")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise _bad(f"{at}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise _bad(f"{at}.function.arguments must be a JSON object")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _bad(f"{at}.id must be a string")
        out.append({"id": call.get("id") or "", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


# ------------------------------------------------------------------ what parsed messages hold

def message_text(message: dict) -> str:
    """A parsed message's content as one string (text parts joined with newlines)."""
    content = message.get("content") or ""
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content if p["type"] == "text")


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of parsed messages, in prompt order (each has "image_url" or "image_pil")."""
    return [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def media_chars(messages: list[dict]) -> int:
    """The characters of the image and audio URLs in parsed messages (base64 data: URLs, mostly):
    a request body's size less these is what its chat template renders, since an item is only a
    placeholder there."""
    return sum(len(p.get("image_url") or p.get("audio_url") or "") for m in messages
               if isinstance(m["content"], list) for p in m["content"] if p["type"] in ("image", "audio"))


def image_urls(messages: list[dict]) -> list[str]:
    """The image URLs of parsed messages, in prompt order (an HTTP request's images)."""
    return [p["image_url"] for p in image_parts(messages) if "image_url" in p]


def audio_urls(messages: list[dict]) -> list[str]:
    """The audio URLs of parsed messages (input_audio parts as data: URLs), in prompt order."""
    return [p["audio_url"] for m in messages if isinstance(m["content"], list) for p in m["content"]
            if p["type"] == "audio"]


def audio_items(messages: list[dict], allowed_dir: str | None) -> list[bytes]:
    """Offline: the encoded bytes of each audio part (data: and file: URLs), in order; the
    processor decodes them at the model's sample rate."""
    from multimodal.audio import MAX_AUDIO_BYTES, decode_base64
    from multimodal.media import MediaError, read_file_url
    out = []
    for url in audio_urls(messages):
        if url.lower().startswith("data:"):
            out.append(decode_base64(url.partition(",")[2], "the data URL"))
        elif url.lower().startswith("file:"):
            out.append(read_file_url(url, allowed_dir, MAX_AUDIO_BYTES, "audio"))
        else:
            raise MediaError("offline audio URLs must be data: or file:// URLs")
    return out


def load_images(messages: list[dict], allowed_dir: str | None) -> list:
    """Offline: the images of parsed messages, loaded (data: and file: URLs, PIL images), in order;
    a MediaError for one that cannot be. (The API server fetches its own, http(s) included, off
    its event loop: multimodal/processor.py.)"""
    from multimodal.media import as_image, load_data_url, load_file_url
    images = []
    for part in image_parts(messages):
        url = part.get("image_url")
        if url is None:
            images.append(as_image(part["image_pil"]))
        else:
            images.append(load_data_url(url) if url.startswith("data:") else load_file_url(url, allowed_dir))
    return images


# ------------------------------------------------------------------ the chat template

def detect_content_format(template: str | None) -> str:
    """vLLM's "auto" chat_template_content_format: "openai" when the template loops over a message's
    content (it expects a list of parts), else "string"."""
    if not template:
        return "string"
    import jinja2
    from jinja2 import nodes
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"

    def is_content(node) -> bool:
        return ((isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")
                or (isinstance(node, nodes.Getattr) and node.attr == "content"))
    aliases = {t.target.name for t in ast.find_all(nodes.Assign)
               if isinstance(t.target, nodes.Name) and is_content(t.node)}
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter):   # e.g. message['content'] | selectattr(...)
            it = it.node
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in aliases):
            return "openai"
    return "string"


def _template_kwargs(add_generation_prompt: bool, continue_final_message: bool, tools: list | None,
                     chat_template_kwargs: dict | None, chat_template: str | None) -> dict:
    """apply_chat_template's keywords, besides the messages and tokenize=False."""
    if add_generation_prompt and continue_final_message:
        raise RequestError("add_generation_prompt and continue_final_message cannot both be true",
                           "continue_final_message")
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items()
              if k not in ("tokenize", "conversation", "messages")}
    kwargs.update(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
    if tools:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return kwargs


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list | None = None,
                chat_template_kwargs: dict | None = None, add_special_tokens: bool = False,
                chat_template: str | None = None, limit: int | None = None) -> tuple[str, list[int]]:
    """Apply the chat template (the model's, or `chat_template`) to parsed messages
    (parse_chat_messages); returns (prompt text, token ids). The template writes the special
    tokens it wants, so the text is encoded without the tokenizer's own (vLLM's default).
    `limit`: a prompt surely longer is refused before it is tokenized in full (encode_bounded)."""
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("This model has no chat template; use /v1/completions instead.", "messages")
    kwargs = _template_kwargs(add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
                              chat_template)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja TemplateError (raise_exception in the template), bad messages, ...
        raise RequestError(f"Cannot apply the chat template: {e}", "messages") from None
    if not isinstance(text, str):  # some versions return a list for batched input
        text = text[0]
    return text, encode_bounded(tokenizer, text, add_special_tokens, limit)
