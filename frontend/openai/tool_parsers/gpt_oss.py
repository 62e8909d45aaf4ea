"""gpt_oss (gpt-oss): tool calls are harmony messages on the commentary channel addressed to
`functions.NAME`. Their markers are special tokens that the detokenized text drops, so they are
parsed from the output's token ids by openai-harmony (frontend/openai/harmony.py: ChatOutput takes
that path for a harmony model, and streams each call's arguments through HarmonyCalls below);
selecting this parser on another model turns that path on. On the text alone there is nothing
to find: all of it is content."""
from __future__ import annotations

import json

from frontend.openai.tool_parsers.abstract import ToolParser, ToolStream
from frontend.openai.tool_parsers.json_stream import JsonValue


class GptOssToolParser(ToolParser):
    harmony = True   # the calls come from the token ids (frontend/openai/harmony.py)

    def stream(self) -> ToolStream:
        return _AllContent(self)


class _AllContent(ToolStream):
    def _run(self, final: bool) -> None:
        self.emit_content(self.text[self.pos:])
        self.pos = len(self.text)


class HarmonyCalls(ToolStream):
    """The calls of a harmony output as it is parsed: `message(name)` when a message to
    `functions.NAME` starts, `feed(text)` with its content as it comes, `end_message()` when it
    ends, `finish()` at the output's end. The arguments stream as canonical JSON
    (json_stream.JsonValue), valid JSON at every end; arguments that are not JSON at all come
    whole when their message ends, as a JSON string ("{}" when blank)."""

    def __init__(self):
        super().__init__(GptOssToolParser())
        self.value: JsonValue | None = None
        self.start = 0   # where the open call's text started

    def message(self, name: str) -> None:
        self.end_message()
        self.begin_call(name)
        self.value = JsonValue()
        self.start = self.pos = len(self.text)

    def _run(self, final: bool) -> None:
        if self.value is not None and not self.value.done:
            self.pos = self.value.read(self.text, self.pos, False)
            self.emit_arguments(self.value.take())
        if final:
            self.end_message()

    def end_message(self) -> None:
        v, self.value = self.value, None
        if v is None:
            return
        if not v.done:
            self.pos = v.read(self.text, self.pos, True)
            self.emit_arguments(v.take())
        if not v.started:
            raw = self.text[self.start:]
            self.emit_arguments(json.dumps(raw, ensure_ascii=False) if raw.strip() else "{}")
        self.pos = len(self.text)
