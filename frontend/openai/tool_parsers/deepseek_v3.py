"""deepseek_v3 (DeepSeek-V3, R1-0528): after the content,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

one call block per call. The V3.1 layout (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`) is
read too. A block that is not a call ends the parsing; the rest stays content."""
from __future__ import annotations

import re

from frontend.openai.tool_parsers.abstract import ToolParser, ToolStream
from frontend.openai.tool_parsers.json_stream import JsonValue

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_BLANK = re.compile(r"\s*")
TEXT, CALLS, HEAD, NAME, FENCE, ARGS, TAIL, REST = range(8)


class DeepSeekV3ToolParser(ToolParser):
    keeps_special_tokens = True   # the markers are special tokens

    def stream(self) -> DeepSeekV3Stream:
        return DeepSeekV3Stream(self)


class DeepSeekV3Stream(ToolStream):
    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.state = TEXT
        self.block = 0          # where the call being read started (content from there, when it is none)
        self.head = ""
        self.name = ""
        self.value: JsonValue | None = None
        self.open = False       # the call began

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            n = len(text)
            if self.state == TEXT:
                at = self.text_until(CALLS_BEGIN, final)
                if at is None:
                    return
                self.block = at
                self.pos = at + len(CALLS_BEGIN)
                self.state = CALLS
            elif self.state == CALLS:   # the next call, or the end of the calls
                p = _BLANK.match(text, self.pos).end()
                if text.startswith(CALL_BEGIN, p):
                    if self.calls:
                        self.block = p
                    self.pos, self.state = p + len(CALL_BEGIN), HEAD
                elif text.startswith(CALLS_END, p):
                    self.pos, self.state, self.after_call = p + len(CALLS_END), TEXT, True
                elif not final and (CALL_BEGIN.startswith(text[p:]) or CALLS_END.startswith(text[p:])):
                    return
                else:
                    self._rest(p if self.calls else self.block)
            elif self.state == HEAD:    # "function" (V3) or the name (V3.1), up to the separator
                sep = text.find(SEP, self.pos)
                if sep < 0:
                    if final or "\n" in text[self.pos:]:
                        self._rest(self.block)
                        continue
                    return
                self.head = text[self.pos:sep].strip()
                self.pos, self.state = sep + len(SEP), NAME
            elif self.state == NAME:    # V3: the name's line, then a fence; V3.1: the arguments at once
                p = _BLANK.match(text, self.pos).end()
                if p == n and not final:
                    return
                if text.startswith("{", p):
                    self.name = self.head
                    self._arguments(p)
                    continue
                eol = text.find("\n", p)
                if eol < 0:
                    if final:
                        self._rest(self.block)
                        continue
                    return
                self.name = text[p:eol].strip()
                self.pos, self.state = eol, FENCE
            elif self.state == FENCE:   # ```json before the arguments
                p = _BLANK.match(text, self.pos).end()
                if text.startswith("```", p):
                    q = p + 3
                    if text.startswith("json", q):
                        q += 4
                    elif not final and q + 4 > n and "json".startswith(text[q:]):
                        return
                    self._arguments(q)
                elif text.startswith("{", p):
                    self._arguments(p)
                elif not final and "```".startswith(text[p:]):
                    return
                else:
                    self._rest(self.block)
            elif self.state == ARGS:
                self.pos = self.value.read(text, self.pos, final)
                piece = self.value.take()
                if piece and not self.open:
                    if not self.name:
                        self._rest(self.block)
                        continue
                    self.begin_call(self.name)
                    self.open = True
                self.emit_arguments(piece)
                if not self.value.done:
                    return
                if not self.open:
                    self._rest(self.block)
                    continue
                self.open = False
                self.state = TAIL
            elif self.state == TAIL:    # the closing fence and <｜tool▁call▁end｜>
                end = text.find(CALL_END, self.pos)
                if end < 0:
                    if final:
                        self.pos = n
                    return
                self.pos, self.state = end + len(CALL_END), CALLS
            else:   # REST
                self.emit_content(text[self.pos:])
                self.pos = n
                return

    def _arguments(self, pos: int) -> None:
        self.pos, self.value, self.state = pos, JsonValue(), ARGS

    def _rest(self, pos: int) -> None:
        """Not a call: content from `pos` on."""
        self.pos, self.state = pos, REST
