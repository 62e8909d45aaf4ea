"""JsonValue: one JSON value read incrementally from a growing text and re-emitted as canonical
JSON (json.dumps(value, ensure_ascii=False): ", " and ": " separators, only the escapes JSON
needs), so that a tool call's streamed `arguments` deltas are the same text whatever the
chunking, and equal the non-streamed call's.

Why not re-parse the partial text each time (vLLM's partial_json_parser diffing): that loses a
closing brace or breaks nested objects when a chunk boundary falls in the wrong place. Here every
character is read once, by a state machine, and what is emitted is always a prefix that closes
into valid JSON: an object key (and its ", ") is held back until its value starts, a number or
literal until it is complete, an escape until it is whole. When the text ends early (max_tokens)
or stops being JSON, `close()` ends the open string and containers, so the concatenated deltas
are still valid JSON (the value cut short, never broken). The reader is lenient where models
are sloppy: raw control characters in strings are escaped, a lone surrogate escape becomes
U+FFFD (no UTF-8 response could carry it), an unknown escape keeps its backslash."""
from __future__ import annotations

import json
import math
import re

_WS = re.compile(r"[ \t\r\n]*")
_STR_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMISH = re.compile(r"[-+0-9.eE]+")   # what could still be part of a number
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_LOW = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = ("true", "false", "null")

# what the reader expects next, outside a string
VALUE, VALUE_OR_END, KEY, KEY_OR_END, COLON, COMMA_OR_END = range(6)


def canonical_chars(s: str) -> str:
    """`s` as the inside of a canonical JSON string."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


def canonical_number(token: str) -> str:
    value = json.loads(token)
    if isinstance(value, float) and not math.isfinite(value):
        return token   # 1e999: JSON allows it, json.dumps would write Infinity (not JSON)
    return json.dumps(value)


class JsonValue:
    """Read one JSON value from `text[pos:]` as it grows: `read(text, pos, final)` consumes what
    it can and returns the new position; `take()` gives the canonical text that became sendable.
    `done` once the value is complete (or failed: then closed, `failed` set, and `pos` is where
    the text stopped being JSON). `started`: something was emitted."""

    def __init__(self):
        self.stack: list[str] = []      # open containers: "{" or "["
        self.expect = VALUE
        self.string: str | None = None  # inside a string: "key" | "value"
        self.hold = ""                  # canonical text not sendable yet (", ", a key, ": ")
        self.out: list[str] = []
        self.done = False
        self.failed = False
        self.started = False

    # ------------------------------------------------------------ output

    def _emit(self, piece: str) -> None:
        self.out.append(self.hold + piece)
        self.hold = ""
        self.started = True

    def take(self) -> str:
        s = "".join(self.out)
        self.out.clear()
        return s

    def _after_value(self) -> None:
        if self.stack:
            self.expect = COMMA_OR_END
        else:
            self.done = True

    def close(self) -> None:
        """End here: what was emitted is closed into valid JSON (nothing, when nothing was)."""
        if self.done:
            return
        self.hold = ""
        closing = '"' if self.string == "value" else ""
        closing += "".join("}" if c == "{" else "]" for c in reversed(self.stack))
        if closing:
            self.out.append(closing)
        self.string = None
        self.stack.clear()
        self.done = self.failed = True

    # ------------------------------------------------------------ input

    def read(self, text: str, pos: int, final: bool) -> int:
        n = len(text)
        while not self.done:
            if self.string is not None:
                pos = self._string(text, pos, final)
                if self.string is not None:
                    break   # the string goes on past what there is
                continue
            pos = _WS.match(text, pos).end()
            if pos >= n:
                if final:
                    self.close()
                break
            c = text[pos]
            e = self.expect
            if e == COMMA_OR_END:
                top = self.stack[-1]
                if c == ",":
                    self.hold = ", "
                    self.expect = KEY if top == "{" else VALUE
                    pos += 1
                elif c == ("}" if top == "{" else "]"):
                    self.stack.pop()
                    self._emit(c)
                    self._after_value()
                    pos += 1
                else:
                    self.close()
            elif e == COLON:
                if c != ":":
                    self.close()
                    break
                self.hold += ": "
                self.expect = VALUE
                pos += 1
            elif e == KEY or e == KEY_OR_END:
                if c == '"':
                    self.hold += '"'
                    self.string = "key"
                    pos += 1
                elif c == "}" and e == KEY_OR_END:
                    self.stack.pop()
                    self._emit(c)
                    self._after_value()
                    pos += 1
                else:
                    self.close()
            else:   # a value
                if c == "]" and e == VALUE_OR_END:
                    self.stack.pop()
                    self._emit(c)
                    self._after_value()
                    pos += 1
                elif c == "{" or c == "[":
                    self._emit(c)
                    self.stack.append(c)
                    self.expect = KEY_OR_END if c == "{" else VALUE_OR_END
                    pos += 1
                elif c == '"':
                    self._emit('"')
                    self.string = "value"
                    pos += 1
                elif c == "-" or "0" <= c <= "9":
                    end = _NUMISH.match(text, pos).end()
                    if end == n and not final:
                        break   # the number may go on
                    m = _NUM.match(text, pos, end)   # its longest valid start
                    if m is None:
                        self.close()
                        break
                    self._emit(canonical_number(m.group()))
                    pos = m.end()
                    self._after_value()
                else:
                    lit = next((w for w in _LITERALS if text.startswith(w, pos)), None)
                    if lit is not None:
                        self._emit(lit)
                        pos += len(lit)
                        self._after_value()
                    elif not final and any(w.startswith(text[pos:]) for w in _LITERALS):
                        break
                    else:
                        self.close()
        return pos

    def _string(self, text: str, pos: int, final: bool) -> int:
        """Inside a string: its characters as canonical text; ends the string at its quote."""
        n = len(text)
        sink = self.out if self.string == "value" else None
        while pos < n:
            m = _STR_RUN.match(text, pos)
            if m is not None:
                self._chars(m.group(), sink)
                pos = m.end()
                continue
            c = text[pos]
            if c == '"':
                pos += 1
                if sink is not None:
                    self.out.append('"')
                    self.string = None
                    self._after_value()
                else:
                    self.hold += '"'
                    self.string = None
                    self.expect = COLON
                return pos
            if c != "\\":   # a raw control character: escaped
                self._chars(c, sink)
                pos += 1
                continue
            if pos + 1 >= n:
                break
            e = text[pos + 1]
            if e != "u":
                self._chars(_SIMPLE_ESCAPES.get(e, "\\" + e), sink)
                pos += 2
                continue
            if pos + 6 > n and not final:
                break
            if not _HEX4.fullmatch(text, pos + 2, pos + 6):
                self._chars("\\u", sink)   # not an escape after all: kept as text
                pos += 2
                continue
            cp = int(text[pos + 2:pos + 6], 16)
            if 0xD800 <= cp < 0xDC00:   # a pair's first half: its second must follow
                if pos + 12 > n and not final and _LOW.match(text[pos + 6:] + "\\uDC00"[n - pos - 6:]):
                    break
                if _LOW.match(text, pos + 6):
                    low = int(text[pos + 8:pos + 12], 16)
                    self._chars(chr(0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)), sink)
                    pos += 12
                    continue
                cp = 0xFFFD
            elif 0xDC00 <= cp < 0xE000:
                cp = 0xFFFD
            self._chars(chr(cp), sink)
            pos += 6
        if final:
            self.close()
        return pos

    def _chars(self, s: str, sink: list | None) -> None:
        s = canonical_chars(s) if ('"' in s or "\\" in s or not s.isprintable()) else s
        if sink is not None:
            sink.append(s)
        else:
            self.hold += s


def canonical_json(text: str) -> tuple[str, int]:
    """A whole text's leading JSON value, canonical (closed if cut short), and where it ended;
    ("", 0) when the text does not start with one."""
    v = JsonValue()
    pos = v.read(text, 0, final=True)
    return v.take(), pos
