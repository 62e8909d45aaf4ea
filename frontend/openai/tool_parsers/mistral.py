"""mistral (Mistral, Mixtral, Ministral, Devstral, Magistral): after the content, [TOOL_CALLS]
then either a JSON array of {"name": ..., "arguments": {...}} (tokenizers up to v7) or, from
v11, one `NAME[ARGS]{...}` per call, each after its own [TOOL_CALLS] (an optional
`[CALL_ID]ID` before [ARGS] is read and dropped). Mistral's chat template wants 9-character
alphanumeric call ids, so the calls get those (as vLLM's)."""
from __future__ import annotations

import random
import re
import string

from frontend.openai.tool_parsers.abstract import ToolParser, ToolStream
from frontend.openai.tool_parsers.call_object import CallObject
from frontend.openai.tool_parsers.json_stream import JsonValue

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_BLANK = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ALPHANUMERIC = string.ascii_letters + string.digits
TEXT, AFTER, ITEM, OBJECT, SEP, NAME, VALUE, REST = range(8)


def mistral_call_id() -> str:
    return "".join(random.choices(_ALPHANUMERIC, k=9))


class MistralToolParser(ToolParser):
    keeps_special_tokens = True   # [TOOL_CALLS], [ARGS] are control tokens

    def stream(self) -> MistralStream:
        return MistralStream(self)


class MistralStream(ToolStream):
    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.state = TEXT
        self.block = 0                   # the [TOOL_CALLS] being read (content from there when no call)
        self.item = 0                    # where the array's current object started
        self.call: CallObject | None = None
        self.name = ""
        self.value: JsonValue | None = None
        self._fresh = True               # the v11 call being read has not begun

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            n = len(text)
            if self.state == TEXT:
                at = self.text_until(TOOL_CALLS, final)
                if at is None:
                    return
                self.block = at
                self.pos = at + len(TOOL_CALLS)
                self.state = AFTER
            elif self.state == AFTER:    # an array (v3..v7) or a name (v11+)
                p = _BLANK.match(text, self.pos).end()
                if p == n:
                    if final:
                        self._rest(self.block)
                    return
                if text[p] == "[":
                    self.pos, self.state = p + 1, ITEM
                else:
                    self.pos, self.state = p, NAME
            elif self.state == ITEM:
                p = _BLANK.match(text, self.pos).end()
                if p == n and not final:
                    return
                if text.startswith("{", p):
                    self.item = self.pos = p
                    self.call = CallObject(self, mistral_call_id())
                    self.state = OBJECT
                else:
                    self._rest(self.block)
            elif self.state == OBJECT:
                self.pos = self.call.read(text, self.pos, final)
                if not self.call.done:
                    return
                if not self.call.committed:
                    self._rest(self.item if self.calls else self.block)
                else:
                    self.state = SEP
            elif self.state == SEP:
                p = _BLANK.match(text, self.pos).end()
                if p == n:
                    if final:
                        self.pos = p
                    return
                if text[p] == ",":
                    self.pos, self.state = p + 1, ITEM
                elif text[p] == "]":
                    self.pos, self.state, self.after_call = p + 1, TEXT, True
                else:
                    self._rest(p)
            elif self.state == NAME:     # NAME[ARGS] or NAME[CALL_ID]ID[ARGS]
                at = text.find(ARGS, self.pos)
                if at < 0:
                    if final or "\n" in text[self.pos:]:
                        self._rest(self.block)
                        continue
                    return
                head = text[self.pos:at]
                name = head.split(CALL_ID, 1)[0].strip()
                if not _NAME.fullmatch(name):
                    self._rest(self.block)
                    continue
                self.name = name
                self.pos, self.value, self.state = at + len(ARGS), JsonValue(), VALUE
            elif self.state == VALUE:
                self.pos = self.value.read(text, self.pos, final)
                piece = self.value.take()
                if piece and self._fresh:
                    self.begin_call(self.name, mistral_call_id())
                    self._fresh = False
                self.emit_arguments(piece)
                if not self.value.done:
                    return
                if not self.value.started:
                    self._rest(self.block)
                    continue
                self._fresh = True
                self.state, self.after_call = TEXT, True
            else:   # REST
                self.emit_content(text[self.pos:])
                self.pos = n
                return

    def _rest(self, pos: int) -> None:
        """Not (or no more) calls: content from `pos` on."""
        self.pos, self.state = pos, REST
