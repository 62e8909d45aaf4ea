"""hermes (Qwen2.5, Qwen3, Hermes): <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one
block per call. The text outside the blocks is content; a block that is not a call (not JSON,
no name or no arguments) stays content as it was written."""
from __future__ import annotations

from frontend.openai.tool_parsers.abstract import ToolParser, ToolStream
from frontend.openai.tool_parsers.call_object import CallObject

START, END = "<tool_call>", "</tool_call>"
TEXT, BODY, SKIP, RAW = range(4)


class HermesToolParser(ToolParser):
    def stream(self) -> HermesStream:
        return HermesStream(self)


class HermesStream(ToolStream):
    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.state = TEXT
        self.block = 0                   # where the open block started
        self.call: CallObject | None = None

    def _run(self, final: bool) -> None:
        while True:
            if self.state == TEXT:
                at = self.text_until(START, final)
                if at is None:
                    return
                self.block = at
                self.pos = at + len(START)
                self.call = CallObject(self)
                self.state = BODY
            elif self.state == BODY:
                self.pos = self.call.read(self.text, self.pos, final)
                if not self.call.done:
                    return
                self.state = SKIP if self.call.committed else RAW
            else:   # to the block's end: dropped after a call, the block as content when it was none
                end = self.text.find(END, self.pos)
                if end < 0:
                    if final:
                        if self.state == RAW:
                            self.emit_content(self.text[self.block:])
                        self.pos = len(self.text)
                    return
                if self.state == RAW:
                    self.emit_content(self.text[self.block:end + len(END)])
                self.after_call = self.state == SKIP
                self.pos = end + len(END)
                self.state = TEXT
