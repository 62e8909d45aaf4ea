"""CallObject: one {"name": ..., "arguments": {...}} tool call read incrementally (hermes,
llama3_json, mistral's JSON array). The call begins (its id and name are sent) once the name is
known and its arguments have started, so a JSON object that is not a call ({"name": "Bob"},
{"answer": 1}) sends nothing and stays content; from then on the arguments stream as they come."""
from __future__ import annotations

import json

from frontend.openai.tool_parsers.abstract import ToolStream
from frontend.openai.tool_parsers.json_stream import _WS, JsonValue

OPEN, KEY_OR_END, KEY, COLON, VALUE, COMMA_OR_END = range(6)
ARGUMENT_KEYS = ("arguments", "parameters")


class CallObject:
    def __init__(self, stream: ToolStream, call_id: str | None = None):
        self.stream = stream
        self.call_id = call_id
        self.expect = OPEN
        self.sub: JsonValue | None = None   # the key or value being read
        self.kind = ""                      # what it is: key | name | arguments | other
        self.piece = ""                     # the key's / name's canonical text
        self.key = ""
        self.name: str | None = None
        self.bad_name = False
        self.pending: list[str] = []        # arguments read before the name
        self.arguments_seen = False
        self.committed = False              # the call began (it is a call)
        self.done = False
        self.failed = False                 # (done) the text stopped being the object

    def read(self, text: str, pos: int, final: bool) -> int:
        n = len(text)
        while not self.done:
            if self.sub is not None:
                pos = self.sub.read(text, pos, final)
                piece = self.sub.take()
                if self.kind == "arguments":
                    self._arguments(piece)
                elif self.kind != "other":
                    self.piece += piece
                if not self.sub.done:
                    break
                sub, self.sub = self.sub, None
                if sub.failed:
                    self._end(failed=True)
                    break
                self._value_read()
                continue
            pos = _WS.match(text, pos).end()
            if pos >= n:
                if final:
                    self._end(failed=True)
                break
            c = text[pos]
            e = self.expect
            if e == OPEN:
                if c != "{":
                    self._end(failed=True)
                    break
                self.expect = KEY_OR_END
                pos += 1
            elif e == KEY or e == KEY_OR_END:
                if c == '"':
                    self._sub("key")
                elif c == "}" and e == KEY_OR_END:
                    self._end(failed=False)
                    pos += 1
                else:
                    self._end(failed=True)
            elif e == COLON:
                if c != ":":
                    self._end(failed=True)
                    break
                self.expect = VALUE
                pos += 1
            elif e == VALUE:
                if self.key == "name" and self.name is None and not self.bad_name:
                    self._sub("name")
                elif self.key in ARGUMENT_KEYS and not self.arguments_seen:
                    self.arguments_seen = True
                    self._sub("arguments")
                else:
                    self._sub("other")
            else:   # COMMA_OR_END
                if c == ",":
                    self.expect = KEY
                elif c == "}":
                    self._end(failed=False)
                else:
                    self._end(failed=True)
                    break
                pos += 1
        return pos

    def _sub(self, kind: str) -> None:
        self.sub, self.kind, self.piece = JsonValue(), kind, ""

    def _value_read(self) -> None:
        if self.kind == "key":
            self.key = json.loads(self.piece)
            self.expect = COLON
            return
        if self.kind == "name":
            name = json.loads(self.piece)
            if isinstance(name, str) and name:
                self.name = name
                self._commit()
            else:
                self.bad_name = True   # not a call
        self.expect = COMMA_OR_END

    def _arguments(self, piece: str) -> None:
        if not piece:
            return
        if self.committed:
            self.stream.emit_arguments(piece)
        else:
            self.pending.append(piece)
            self._commit()

    def _commit(self) -> None:
        if self.committed or self.name is None or self.bad_name or not self.pending:
            return
        self.committed = True
        self.stream.begin_call(self.name, self.call_id)
        self.stream.emit_arguments("".join(self.pending))
        self.pending.clear()

    def _end(self, failed: bool) -> None:
        self.done, self.failed = True, failed
