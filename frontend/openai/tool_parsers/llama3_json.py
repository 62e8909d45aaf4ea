"""llama3_json (Llama 3.1/3.2 JSON tool calling): the whole output is one or more
{"name": ..., "parameters": {...}} objects separated by ";", optionally after <|python_tag|>.
An output that does not start so is content; text after the calls that is not another call is
content too."""
from __future__ import annotations

import re

from frontend.openai.tool_parsers.abstract import ToolParser, ToolStream
from frontend.openai.tool_parsers.call_object import CallObject

PYTHON_TAG = "<|python_tag|>"
_BLANK = re.compile(r"\s*")
_SEPARATORS = re.compile(r"[\s;]*")
START, CALL, BETWEEN, PLAIN = range(4)


class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True   # <|python_tag|>

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)


class Llama3JsonStream(ToolStream):
    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.state = START
        self.start = 0                   # where the current object started
        self.call: CallObject | None = None

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            if self.state == START:
                p = _BLANK.match(text).end()
                if text.startswith(PYTHON_TAG, p):
                    p = _BLANK.match(text, p + len(PYTHON_TAG)).end()
                elif not final and PYTHON_TAG.startswith(text[p:]):
                    return   # blank so far, or the tag's beginning
                if p == len(text) and not final:
                    return
                self._object_or_plain(p)
            elif self.state == CALL:
                self.pos = self.call.read(text, self.pos, final)
                if not self.call.done:
                    return
                if self.call.committed:
                    self.state = BETWEEN
                else:   # not a call: from here on (from the start, when there is none before) content
                    self.pos = self.start if self.calls else 0
                    self.state = PLAIN
            elif self.state == BETWEEN:
                p = _SEPARATORS.match(text, self.pos).end()
                if p == len(text):
                    if final:
                        self.pos = p
                    return
                self._object_or_plain(p)
            else:
                self.emit_content(text[self.pos:])
                self.pos = len(text)
                return

    def _object_or_plain(self, p: int) -> None:
        if p < len(self.text) and self.text[p] == "{":
            self.start = self.pos = p
            self.call = CallObject(self)
            self.state = CALL
        else:
            if not self.calls:
                self.pos = 0
            else:
                self.pos = p
            self.state = PLAIN
