"""ToolParser: what every tool-call syntax provides, and the ToolCall it produces."""
from __future__ import annotations

import json
import re
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
    """A tool-call syntax, for one request (its `tools`, whose parameter schemas some syntaxes
    need). `stream()` makes the incremental parser of one output; `extract` parses a whole
    output with the same machine, so streamed and whole results cannot differ."""
    keeps_special_tokens = False   # its markers are special tokens the detokenizer must keep

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []

    def stream(self) -> ToolStream:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the tool calls, None when there are calls and it is only blank; the calls)."""
        s = self.stream()
        content = s.feed(text, final=True).content
        return (None if s.calls and not content.strip() else content), s.calls


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # OpenAI's tool_calls deltas (with index)


class ToolStream:
    """One output's tool-call parser, an incremental state machine: `feed(piece)` as the output
    grows, `finish()` at its end; each returns the content and tool-call deltas it made
    sendable. Every character is read once (`self.pos` into `self.text`), so any chunking of the
    same output gives the same deltas in sum; a call's arguments stream as canonical JSON
    (json_stream.JsonValue), valid JSON at every end. Subclasses implement `_run(final)`."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.pos = 0
        self.calls: list[ToolCall] = []
        self._content: list[str] = []
        self._deltas: list[dict] = []
        self.after_call = False   # a call just ended: the blank run after it is not content

    def feed(self, piece: str, final: bool = False) -> StreamDelta:
        self.text += piece
        self._run(final)
        return self._take()

    def finish(self) -> StreamDelta:
        return self.feed("", final=True)

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> StreamDelta:
        d = StreamDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return d

    def emit_content(self, s: str) -> None:
        """Content: only before the first call (as vLLM's parsers of a whole output), so that every
        API lays out a streamed answer as its whole one (the text, then the calls)."""
        if s and not self.calls:
            self._content.append(s)

    def begin_call(self, name: str, call_id: str | None = None) -> None:
        call = ToolCall(name, "") if call_id is None else ToolCall(name, "", call_id)
        self.calls.append(call)
        self._deltas.append(call.to_openai(len(self.calls) - 1))

    def emit_arguments(self, s: str) -> None:
        """More of the current call's arguments (into this step's delta of that call when it has one)."""
        if not s:
            return
        call = self.calls[-1]
        call.arguments += s
        index = len(self.calls) - 1
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] = last["function"].get("arguments", "") + s
        else:
            self._deltas.append({"index": index, "function": {"arguments": s}})


    def text_until(self, marker: str, final: bool) -> int | None:
        """Content up to `marker` emitted (an end that could still grow into it held back), and
        the marker's position; None when it has not come (yet). The blank run between a call and
        the next marker (or the end) is not content."""
        text, pos = self.text, self.pos
        if self.after_call:
            after = _BLANK.match(text, pos).end()
            if text.startswith(marker, after):
                self.pos = after
                self.after_call = False
                return after
            if after == len(text) or (not final and marker.startswith(text[after:])):
                if final:
                    self.pos = len(text)
                return None
            self.after_call = False
        i = text.find(marker, pos)
        if i >= 0:
            self.emit_content(text[pos:i])
            self.pos = i
            return i
        keep = text[pos:] if final else held_prefix(text[pos:], marker)
        self.emit_content(keep)
        self.pos = pos + len(keep)
        return None


_BLANK = re.compile(r"\s*")


def held_prefix(text: str, marker: str) -> str:
    """`text` up to `marker`, holding back an end that could still grow into it."""
    i = text.find(marker)
    if i >= 0:
        return text[:i]
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text
