"""ToolParser: what every tool-call syntax provides, and the ToolCall it produces."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str                     # JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index   # in a stream's tool_calls delta
        return d


def parsed_call(name, arguments) -> ToolCall:
    """A call as a parser read it from the model's JSON; TypeError or ValueError when it is not
    one a client can read: a name that is not a string, or a string with a lone surrogate
    escape ("\\ud800"), which JSON allows and UTF-8 (the response) cannot carry."""
    if not isinstance(name, str):
        raise TypeError("name is not a string")
    # always JSON, as vLLM: arguments the model wrote as a string become a JSON string (left raw,
    # "str" was not JSON, and a client's json.loads(arguments) failed)
    text = json.dumps(arguments, ensure_ascii=False)
    (name + text).encode("utf-8")   # UnicodeEncodeError is a ValueError
    return ToolCall(name, text)


class ToolParser:
    """Stateless: `extract` reads a whole output; `plain_prefix` says how much of an output still
    being generated is surely plain content (streamed as it comes; the rest waits for the end)."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the tool calls or None, the calls); no calls when it does not parse."""
        raise NotImplementedError

    def plain_prefix(self, text: str, final: bool) -> str:
        raise NotImplementedError


def held_prefix(text: str, marker: str) -> str:
    """`text` up to `marker`, holding back an end that could still grow into it."""
    i = text.find(marker)
    if i >= 0:
        return text[:i]
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text
