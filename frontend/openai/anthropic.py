"""Anthropic's Messages API wire format (POST /v1/messages, /v1/messages/count_tokens): the request
translated into the chat request that /v1/chat/completions runs, the chat answer translated
back (whole, or as Anthropic's stream events), and Anthropic's error shape. Pure: the handlers
are frontend/openai/serving_messages.py.

A request becomes chat messages: `system` (a string or text blocks) a system message; text and
image blocks (base64 or URL, as image_url parts: the chat's image path) the message's content;
an assistant's `tool_use` blocks its tool calls; a user's `tool_result` blocks tool messages
(before the rest of that user turn). A last assistant message is continued (Anthropic's
prefill). tool_choice auto / any / tool / none is the chat's "auto" / "required" / a named tool
/ "none"; `thinking` sets the chat template's enable_thinking (budget_tokens is not enforced);
output_config.format (json_schema) is the chat's response_format, its effort the template's
reasoning_effort; stop_sequences are stop strings.

The answer: the reasoning parser's text a `thinking` block, the content a `text` block, each
tool call a `tool_use` block, in that order; stop_reason end_turn, max_tokens, stop_sequence or
tool_use. A stream: message_start, per block content_block_start / content_block_delta
(thinking_delta, text_delta, input_json_delta) / content_block_stop, then message_delta (the
stop_reason and usage) and message_stop; its blocks add up to the non-streamed message.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from frontend.openai.protocol import APIError, dumps

# ------------------------------------------------------------------ errors

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}

ANTHROPIC_PATH = "/v1/messages"   # it and every path under it answer errors in Anthropic's shape


def error_body(message: str, status: int) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def event(name: str, data: dict) -> bytes:
    """One server-sent event, named as Anthropic names them."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


def error_event(message: str, status: int, param: str | None = None) -> bytes:
    return event("error", error_body(message, status))


# ------------------------------------------------------------------ requests

class _MessagesFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: Any = msgspec.UNSET        # checked by hand
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_MessagesFields, kw_only=True):
    max_tokens: int = msgspec.UNSET      # required, as Anthropic's
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None   # {"format": {"type": "json_schema", "schema"}, "effort"}


class CountTokensRequest(_MessagesFields, kw_only=True):
    pass


def _bad(message: str, param: str = "messages") -> APIError:
    return APIError(message, 400, param)


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or a list of text blocks")
    texts = []
    for b in blocks:
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}: only text blocks are supported here, got {b.get('type') if isinstance(b, dict) else b!r}")
        texts.append(b["text"])
    return "\n".join(texts)


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _bad(f"{where}: an image block needs a source of type 'base64' (media_type, data) or 'url' (url)")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(content: Any, where: str) -> str | list[dict]:
    """A tool_result's content: a string, or text and image blocks (a tool that read a picture),
    as the tool message's content parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text and image blocks")
    parts = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "image":
            parts.append(_image(b, f"{where}[{j}]"))
        elif kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        else:
            raise _bad(f"{where}[{j}]: a tool result holds text and image blocks, got {kind!r}")
    return parts if any(p["type"] != "text" for p in parts) else "\n".join(p["text"] for p in parts)


def chat_messages(messages: Any, system: Any) -> list[dict]:
    """Anthropic's system and messages as OpenAI chat messages."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages")
    out: list[dict] = []
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role must be 'user' or 'assistant'")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content must be a string or a list of content blocks")
        parts: list[dict] = []
        calls: list[dict] = []
        for j, b in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise _bad(f"{at}: a text block needs a string 'text'")
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image":
                parts.append(_image(b, at))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise _bad(f"{at}: a tool_use block needs 'id' and 'name'")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(f"{at}: a tool_result block needs its 'tool_use_id'")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _tool_result(b.get("content") or "", f"{at}.content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue   # an earlier turn's thinking: templates drop it from the history
            else:
                raise _bad(f"{at}: content blocks of type {kind!r} are not supported in a {role} message "
                           "(text, image, tool_use, tool_result, thinking)")
        if parts or calls or not any(b.get("type") == "tool_result" for b in content if isinstance(b, dict)):
            msg: dict = {"role": role, "content": parts if any(p["type"] != "text" for p in parts)
                         else "\n".join(p["text"] for p in parts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _chat_tools(tools: list | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}]: only custom tools ({{name, description, input_schema}}) are supported", "tools")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(the chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
               "tool_choice")


def chat_request(req: MessagesRequest | CountTokensRequest) -> dict:
    """The chat request (as its JSON) that runs this Messages request."""
    messages = chat_messages(req.messages, req.system)
    tool_choice, parallel = _chat_tool_choice(req.tool_choice)
    kwargs = {}
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise _bad("thinking.type must be 'enabled', 'adaptive' or 'disabled'", "thinking")
        kwargs["enable_thinking"] = kind != "disabled"
    response_format = None
    config = getattr(req, "output_config", None) or {}
    if config.get("effort"):
        kwargs["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config")
        response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    prefill = messages[-1]["role"] == "assistant"   # Anthropic's prefill: the answer continues it
    body: dict = {"model": req.model, "messages": messages, "tools": _chat_tools(req.tools),
                  "tool_choice": tool_choice, "parallel_tool_calls": parallel,
                  "chat_template_kwargs": kwargs or None, "response_format": response_format,
                  "add_generation_prompt": not prefill, "continue_final_message": prefill}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stream=bool(req.stream))
    return {k: v for k, v in body.items() if v is not None}


# ------------------------------------------------------------------ answers

def message_id(rid: str) -> str:
    return "msg_" + rid.split("-", 1)[-1]


def tool_use_id(chat_id: str) -> str:
    return "toolu_" + chat_id.removeprefix("chatcmpl-tool-")


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}


def stop_reason(finish_reason: str | None, stop: Any, tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished chat choice."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}


def message(rid: str, model: str, content: list[dict], reason: tuple[str | None, str | None], usage_: dict) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage_}


def content_blocks(chat_message: dict) -> list[dict]:
    """A chat answer's message as Anthropic content blocks."""
    blocks = []
    if chat_message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": chat_message["reasoning_content"], "signature": ""})
    if chat_message.get("content"):
        blocks.append({"type": "text", "text": chat_message["content"]})
    for call in chat_message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                       "input": _input(fn["arguments"])})
    return blocks


@dataclass
class MessageStream:
    """A chat stream's deltas -> Anthropic's events: one open block at a time, in order."""
    start: dict                   # the message of message_start (no content yet)
    index: int = -1               # the open block's index
    kind: str | None = None       # its type: thinking | text | tool_use
    tool_calls: bool = False      # (stop_reason tool_use)

    def begin(self) -> bytes:
        return event("message_start", {"type": "message_start", "message": self.start}) + event("ping", {"type": "ping"})

    def delta(self, delta: dict) -> bytes:
        out = b""
        if delta.get("reasoning_content"):
            out += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):   # a new call
                self.tool_calls = True
                out += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                               "name": fn.get("name"), "input": {}})
            if fn.get("arguments"):
                out += event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": "input_json_delta",
                                                               "partial_json": fn["arguments"]}})
        return out

    def _text(self, kind: str, text: str) -> bytes:
        out = b"" if self.kind == kind else self._open(kind, {"type": kind, kind: "", **(
            {"signature": ""} if kind == "thinking" else {})})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        return out + event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": delta})

    def _open(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.kind = kind
        return out + event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block})

    def _close(self) -> bytes:
        if self.kind is None:
            return b""
        self.kind = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def end(self, reason: tuple[str, str | None], usage_: dict) -> bytes:
        return (self._close()
                + event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                                           "usage": usage_})
                + event("message_stop", {"type": "message_stop"}))
