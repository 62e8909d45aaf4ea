"""OpenAI's Responses API wire format (POST /v1/responses): the request translated into the chat
request that /v1/chat/completions runs, and the chat answer translated back, whole or as the
Responses stream's events. Pure: the handlers are frontend/openai/serving_responses.py.

A request becomes chat messages: `instructions` a system message, `input` a user message (a
string) or items: messages (input_text / output_text / input_image parts), `function_call`
(an assistant's tool call) and `function_call_output` (its result, a tool message). Tools,
tool_choice, text.format (json_schema: structured outputs), max_output_tokens, temperature and
top_p map onto the chat request's fields; `reasoning.effort` goes to the chat template as
`reasoning_effort` (vLLM does the same).

The answer: the reasoning parser's text a `reasoning` item, the content one `message` item with
one `output_text` part, each tool call a `function_call` item, in that order. A stream sends the
same items as OpenAI's events (response.created, response.in_progress, then per item
output_item.added, content_part.added, the deltas, their .done, output_item.done, and
response.completed), each with its sequence_number; the `response` of response.completed is the
object a non-streamed request answers (seed #34188: one message, not one per delta).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from frontend.openai.protocol import APIError, now, sse


def _hex() -> str:
    return uuid.uuid4().hex


class ResponseTextConfig(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """OpenAI's fields (and vLLM's sampling extras top_k, min_p, seed, ...); others are ignored."""
    model: str | None = None
    input: Any = msgspec.UNSET                 # str | list of items; checked by hand
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None    # {"effort": ..., "summary": ...}
    text: ResponseTextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    store: bool | None = None                  # OpenAI's default: true
    background: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    priority: int | None = None


# ------------------------------------------------------------------ request -> chat

def input_messages(input_: Any) -> list[dict]:
    """The request's `input` as chat messages (OpenAI chat shape, as /v1/chat/completions takes)."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise APIError("'input' must be a string or a non-empty list of items", 400, "input")
    messages: list[dict] = []
    for i, item in enumerate(input_):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}] must be an object", 400, "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = _function_call(item, i)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":   # its text, then its calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(f"input[{i}]: a function_call_output needs its 'call_id'", 400, "input")
            if isinstance(output, list):
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            if not isinstance(output, str):
                raise APIError(f"input[{i}].output must be a string", 400, "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue   # an earlier turn's reasoning: templates drop it from the history
        else:
            raise APIError(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output, reasoning)", 400, "input")
    return messages


_ROLES = ("user", "assistant", "system", "developer")


def _message(item: dict, i: int) -> dict:
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise APIError(f"input[{i}].role must be one of {list(_ROLES)}, got {role!r}", 400, "input")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(f"input[{i}].content must be a string or a list of content parts", 400, "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise APIError(f"input[{i}].content: a {kind} part needs a string 'text'", 400, "input")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(f"input[{i}].content: an input_image part needs an 'image_url' (a URL or a data: "
                               "URL; file_id is not supported)", 400, "input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise APIError(f"input[{i}].content: parts of type {kind!r} are not supported (input_text, "
                           "output_text, input_image)", 400, "input")
    return {"role": role, "content": parts}


def _function_call(item: dict, i: int) -> dict:
    name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(args, str):
        raise APIError(f"input[{i}]: a function_call needs 'call_id', 'name' and 'arguments' (strings)", 400,
                       "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _chat_tools(tools: list | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(f"tools[{i}]: only tools of type 'function' are supported, got {kind!r}", 400, "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                   400, "tool_choice")


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", 400,
                   "text.format")


def chat_request(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat request (as its JSON) that runs this Responses request after the `history` of its
    previous_response_id; the messages without the instructions are `conversation(...)`."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    kwargs = {}
    if req.reasoning and req.reasoning.get("effort"):
        kwargs["reasoning_effort"] = req.reasoning["effort"]
    body = {"model": req.model, "messages": messages, "tools": _chat_tools(req.tools),
            "tool_choice": _chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed, "repetition_penalty": req.repetition_penalty,
            "stop": req.stop, "response_format": _response_format(req.text.format if req.text else None),
            "chat_template_kwargs": kwargs or None, "stream": bool(req.stream), "priority": req.priority}
    return {k: v for k, v in body.items() if v is not None}


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages that continue the conversation."""
    return input_messages([{k: v for k, v in item.items() if k != "id"} for item in output
                           if item["type"] in ("message", "function_call")]) if output else []


# ------------------------------------------------------------------ chat -> response

def skeleton(rid: str, req: ResponsesRequest, model: str, status: str) -> dict:
    """The response object before its output: what every event's `response` carries."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
    return {"id": rid, "object": "response", "created_at": now(), "status": status, "background": bool(req.background),
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "model": model,
            "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_p": req.top_p, "truncation": req.truncation or "disabled", "usage": None, "user": req.user}


def finish(response: dict, output: list[dict], finish_reason: str | None, chat_usage: dict) -> dict:
    """The response, done: its output, status and usage (from the chat answer's)."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    response["output"] = output
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    elif finish_reason == "abort":
        response["status"] = "cancelled"
    else:
        response["status"] = "completed"
    response["usage"] = {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                         "output_tokens": chat_usage["completion_tokens"],
                         "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": chat_usage["total_tokens"]}
    return response


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"id": rid or f"rs_{_hex()}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [], "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"id": rid or f"msg_{_hex()}", "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def call_id(chat_id: str) -> str:
    return "call_" + chat_id.removeprefix("chatcmpl-tool-")


def function_call_item(call: dict, status: str = "completed", rid: str | None = None) -> dict:
    fn = call["function"]
    return {"id": rid or f"fc_{_hex()}", "type": "function_call", "call_id": call_id(call["id"]), "name": fn["name"],
            "arguments": fn.get("arguments", "") if status == "completed" else "", "status": status}


def output_items(message: dict) -> list[dict]:
    """A chat answer's message as the response's output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or ""))
    items += [function_call_item(c) for c in calls]
    return items


@dataclass
class _Open:
    """The output item a stream is in the middle of."""
    kind: str           # reasoning | message | function_call
    index: int          # its output_index
    item_id: str
    text: str = ""
    call: dict | None = None


@dataclass
class ResponseStream:
    """A chat stream's deltas -> the Responses API's events (SSE bytes), and the output they add up to."""
    response: dict
    seq: int = 0
    output: list[dict] = field(default_factory=list)
    open: _Open | None = None
    calls: dict[int, _Open] = field(default_factory=dict)   # chat tool-call index -> its item

    def event(self, type_: str, **fields) -> bytes:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + type_.encode() + b"\n" + sse(ev)

    def begin(self) -> bytes:
        return (self.event("response.created", response=self.response)
                + self.event("response.in_progress", response=self.response))

    def delta(self, delta: dict) -> bytes:
        out = b""
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        return out

    def _text(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open is None or self.open.kind != kind:
            out += self._close()
            rid = f"{'rs' if kind == 'reasoning' else 'msg'}_{_hex()}"
            self.open = _Open(kind, len(self.output), rid)
            self.output.append({})   # its place
            item = reasoning_item("", "in_progress", rid) if kind == "reasoning" else message_item("", "in_progress",
                                                                                                   rid)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
            out += self.event("response.output_item.added", output_index=self.open.index, item=item)
            out += self.event("response.content_part.added", item_id=rid, output_index=self.open.index,
                              content_index=0, part=part)
        if not text:
            return out
        self.open.text += text
        extra = {} if kind == "reasoning" else {"logprobs": []}
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return out + self.event(name, item_id=self.open.item_id, output_index=self.open.index, content_index=0,
                                delta=text, **extra)

    def _call(self, call: dict) -> bytes:
        out = b""
        fn = call.get("function") or {}
        if call.get("id"):   # a new call
            out += self._close()
            chat_call = {"id": call["id"], "function": {"name": fn.get("name"), "arguments": ""}}
            item = function_call_item(chat_call, "in_progress")
            self.open = _Open("function_call", len(self.output), item["id"], call=item)
            self.calls[call.get("index", len(self.calls))] = self.open
            self.output.append({})
            out += self.event("response.output_item.added", output_index=self.open.index, item=item)
        target = self.calls.get(call.get("index", 0), self.open)
        args = fn.get("arguments") or ""
        if args and target is not None:
            target.text += args
            out += self.event("response.function_call_arguments.delta", item_id=target.item_id,
                              output_index=target.index, delta=args)
        return out

    def _close(self) -> bytes:
        o, self.open = self.open, None
        if o is None:
            return b""
        if o.kind == "function_call":
            item = {**o.call, "arguments": o.text, "status": "completed"}
            out = self.event("response.function_call_arguments.done", item_id=o.item_id, output_index=o.index,
                             name=item["name"], arguments=o.text)
        elif o.kind == "reasoning":
            item = reasoning_item(o.text, rid=o.item_id)
            part = item["content"][0]
            out = (self.event("response.reasoning_text.done", item_id=o.item_id, output_index=o.index,
                              content_index=0, text=o.text)
                   + self.event("response.content_part.done", item_id=o.item_id, output_index=o.index,
                                content_index=0, part=part))
        else:
            item = message_item(o.text, rid=o.item_id)
            out = (self.event("response.output_text.done", item_id=o.item_id, output_index=o.index, content_index=0,
                              text=o.text, logprobs=[])
                   + self.event("response.content_part.done", item_id=o.item_id, output_index=o.index,
                                content_index=0, part=item["content"][0]))
        self.output[o.index] = item
        return out + self.event("response.output_item.done", output_index=o.index, item=item)

    def end(self, finish_reason: str | None, chat_usage: dict) -> bytes:
        """The last items closed, then response.completed (or .incomplete) with the whole response."""
        out = self._close()
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            out += self._text("message", "") + self._close()   # as whole: an empty answer is one empty message
        finish(self.response, self.output, finish_reason, chat_usage)
        name = {"incomplete": "response.incomplete", "cancelled": "response.cancelled"}.get(
            self.response["status"], "response.completed")
        return out + self.event(name, response=self.response)

    def error(self, message: str, code: int) -> bytes:
        return self.event("error", code=str(code), message=message, param=None)

