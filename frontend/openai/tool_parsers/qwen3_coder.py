"""qwen3_coder (Qwen3-Coder, Qwen3-Next, Qwen3.5): XML calls after the content,

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; its type comes from the tool's JSON schema (as vLLM's
_convert_param_value): string (streamed as it comes), integer, number, boolean, object/array
(JSON, then a Python literal); "null" is null; a parameter the schema does not name is a string.
One newline after <parameter=P> and one before </parameter> are the layout's, not the value's.
A value without </parameter> ends at the next <parameter= or </function>."""
from __future__ import annotations

import ast
import json
import re

from frontend.openai.tool_parsers.abstract import ToolParser, ToolStream
from frontend.openai.tool_parsers.json_stream import canonical_chars

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)
_BLANK = re.compile(r"\s*")
TEXT, HEAD, PARAMS, VALUE, TAIL, REST = range(6)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def param_types(tools: list[dict]) -> dict[str, dict[str, str]]:
    """tool name -> parameter name -> its schema type (lower case; the first that is not null)."""
    out: dict[str, dict[str, str]] = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        types = {}
        for p, schema in props.items() if isinstance(props, dict) else ():
            kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
            if isinstance(kind, list):
                kind = next((k for k in kind if k != "null"), "string")
            types[p] = str(kind).strip().lower()
        out[str(fn.get("name"))] = types
    return out


def convert(value: str, kind: str | None):
    """A parameter's text as its schema type says (vLLM's rules); the text when it does not read."""
    if value.lower() == "null":
        return None
    if kind is None or kind in _STRING_TYPES:
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            f = float(value)
            return int(f) if f.is_integer() else f
    except (ValueError, OverflowError):
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def dumps(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):   # inf, a set, bytes...: as text
        return json.dumps(str(value), ensure_ascii=False)


class Qwen3CoderToolParser(ToolParser):
    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self.types = param_types(self.tools)

    def stream(self) -> Qwen3CoderStream:
        return Qwen3CoderStream(self)


class Qwen3CoderStream(ToolStream):
    parser: Qwen3CoderToolParser

    def __init__(self, parser: Qwen3CoderToolParser):
        super().__init__(parser)
        self.state = TEXT
        self.block = 0
        self.types: dict[str, str] = {}
        self.params = 0          # parameters written in the open call
        self.param = ""
        self.kind: str | None = None
        self.vstart = -1         # where the value starts (-1: not known yet)
        self.vsent = -1          # how far a streamed string value was sent (-1: not begun)

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            n = len(text)
            if self.state == TEXT:
                at = self.text_until(START, final)
                if at is None:
                    return
                self.block, self.pos, self.state = at, at + len(START), HEAD
            elif self.state == HEAD:     # <function=NAME>
                p = _BLANK.match(text, self.pos).end()
                close = text.find(">", p)
                if not text.startswith(FUNCTION, p) or close < 0:
                    if not final and close < 0 and (FUNCTION.startswith(text[p:]) or text.startswith(FUNCTION, p)) \
                            and "\n" not in text[p:]:
                        return
                    self.pos, self.state = self.block, REST   # not a call: content
                    continue
                name = text[p + len(FUNCTION):close].strip()
                if not name or "\n" in name or "<" in name:
                    self.pos, self.state = self.block, REST
                    continue
                self.types = self.parser.types.get(name, {})
                self.begin_call(name)
                self.emit_arguments("{")
                self.params = 0
                self.pos, self.state = close + 1, PARAMS
            elif self.state == PARAMS:   # <parameter=P>, or </function>
                p = _BLANK.match(text, self.pos).end()
                if text.startswith(PARAMETER, p):
                    close = text.find(">", p)
                    if close < 0:
                        if final:
                            self._close_call(n)
                        return
                    self.param = text[p + len(PARAMETER):close].strip()
                    self.kind = self.types.get(self.param)
                    self.vstart, self.vsent = -1, -1
                    self.pos, self.state = close + 1, VALUE
                elif text.startswith(FUNCTION_END, p):
                    self._close_call(p + len(FUNCTION_END))
                elif p == n or (not final and any(m.startswith(text[p:]) for m in (PARAMETER, FUNCTION_END))):
                    if final:
                        self._close_call(n)
                    return
                else:   # something else between parameters: passed over
                    lt = text.find("<", p + 1)
                    if lt < 0:
                        if final:
                            self._close_call(n)
                        return
                    self.pos = lt
            elif self.state == VALUE:
                if not self._value(final):
                    return
            elif self.state == TAIL:     # to </tool_call>
                end = text.find(END, self.pos)
                if end < 0:
                    if final:
                        self.pos = n
                    return
                self.pos, self.state, self.after_call = end + len(END), TEXT, True
            else:   # REST
                self.emit_content(text[self.pos:])
                self.pos = n
                return

    def _value(self, final: bool) -> bool:
        """Read the parameter's value; True when it ended."""
        text, n = self.text, len(self.text)
        if self.vstart < 0:   # one newline after the tag is layout
            if self.pos == n and not final:
                return False
            self.vstart = self.pos + 1 if text.startswith("\n", self.pos) else self.pos
        end, marker = min(((i, m) for m in _VALUE_ENDS if (i := text.find(m, self.vstart)) >= 0),
                          default=(-1, ""))
        if end < 0 and not final:
            if self.kind is None or self.kind in _STRING_TYPES:
                self._stream_string(_held_end(text, self.vstart))
            return False
        stop = n if end < 0 else end
        value_end = stop - 1 if stop > self.vstart and text[stop - 1] == "\n" else stop
        if self.vsent >= 0:   # a string on its way: the rest of it
            self.emit_arguments(canonical_chars(text[self.vsent:value_end]) + '"')
        else:
            self._key()
            self.emit_arguments(dumps(convert(text[self.vstart:value_end], self.kind)))
        self.params += 1
        self.pos = stop + len(PARAMETER_END) if marker == PARAMETER_END else stop
        self.state = PARAMS
        return True

    def _stream_string(self, limit: int) -> None:
        """A string value sent up to `limit` (less a last newline, which may be layout); not
        while it could still be "null"."""
        if limit > self.vstart and self.text[limit - 1] == "\n":
            limit -= 1
        if self.vsent < 0:
            if "null".startswith(self.text[self.vstart:limit].lower()):
                return
            self._key()
            self.emit_arguments('"')
            self.vsent = self.vstart
        if limit > self.vsent:
            self.emit_arguments(canonical_chars(self.text[self.vsent:limit]))
            self.vsent = limit

    def _key(self) -> None:
        self.emit_arguments((", " if self.params else "") + json.dumps(self.param, ensure_ascii=False) + ": ")

    def _close_call(self, pos: int) -> None:
        self.emit_arguments("}")
        self.pos, self.state = pos, TAIL


def _held_end(text: str, start: int) -> int:
    """Where a value's text is surely its own: before an end that could still become one of the
    markers that end it."""
    n = len(text)
    lt = text.rfind("<", max(start, n - len(PARAMETER_END)))
    if lt >= 0 and any(m.startswith(text[lt:]) for m in _VALUE_ENDS):
        return lt
    return n
