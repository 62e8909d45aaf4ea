"""pythonic (Llama 3.2/4, ToolACE and others): the whole output is a Python list of calls with
keyword arguments, `[get_weather(city="Rome", days=3), add(a=1, b=2)]`, optionally between
<|python_start|> and <|python_end|> (Llama 4). Each argument's value is a Python literal, read
by `ast.literal_eval` once it is whole (its end found by a small scanner that knows Python's
strings and brackets); the call begins at its first argument that reads (or at its ")"), so an
output that is not such a list stays content."""
from __future__ import annotations

import ast
import json
import re

from frontend.openai.tool_parsers.abstract import ToolParser, ToolStream

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_BLANK = re.compile(r"\s*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_PLAIN_RUN = re.compile(r"""[^'"()\[\]{},]+""")
_STRING_RUN = re.compile(r"""[^'"\\]+""")
START, NAME, OPEN, KEYWORD, VALUE, AFTER, TAIL, PLAIN = range(8)


class PythonicToolParser(ToolParser):
    keeps_special_tokens = True   # <|python_start|>

    def stream(self) -> PythonicStream:
        return PythonicStream(self)


class PythonicStream(ToolStream):
    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.state = START
        self.name = ""
        self.open = False          # the call being read has begun
        self.args = 0              # its arguments written
        self.keyword = ""
        self.vstart = 0            # the value being scanned: where it starts,
        self.scan = 0              # how far the scanner got,
        self.depth = 0             # its bracket depth,
        self.quote = ""            # the string it is in ("" outside)

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            n = len(text)
            p = _BLANK.match(text, self.pos).end()
            if p == n and not final and self.state not in (VALUE, PLAIN):
                return
            if self.state == START:
                if text.startswith(PY_START, p):
                    p = _BLANK.match(text, p + len(PY_START)).end()
                elif not final and PY_START.startswith(text[p:]):
                    return
                if p == n and not final:
                    return
                if text.startswith("[", p):
                    self.pos, self.state = p + 1, NAME
                else:
                    self._fail(0)
            elif self.state == NAME:
                m = _IDENT.match(text, p)
                if m is None or (m.end() == n and not final):
                    if m is None:
                        self._fail(p)
                        continue
                    return
                self.name, self.pos, self.state = m.group(), m.end(), OPEN
            elif self.state == OPEN:
                if not text.startswith("(", p):
                    self._fail(p)
                    continue
                self.open, self.args = False, 0
                self.pos, self.state = p + 1, KEYWORD
            elif self.state == KEYWORD:   # NAME= of the next argument, or the call's ")"
                if text.startswith(")", p):
                    if not self.open:
                        self.begin_call(self.name)
                        self.emit_arguments("{")
                    self._end_call()
                    self.pos, self.state = p + 1, AFTER
                    continue
                m = _IDENT.match(text, p)
                if m is None:
                    self._fail(p)
                    continue
                q = _BLANK.match(text, m.end()).end()
                if q == n and not final:
                    return
                if not text.startswith("=", q) or text.startswith("==", q):
                    self._fail(p)
                    continue
                self.keyword = m.group()
                self.vstart = self.scan = q + 1
                self.depth, self.quote = 0, ""
                self.pos, self.state = q + 1, VALUE
            elif self.state == VALUE:
                end = self._scan(final)
                if end is None or end < 0:
                    if final or end is not None:
                        self._fail(self.vstart)
                        continue
                    return
                try:
                    value = ast.literal_eval(text[self.vstart:end].strip())
                    encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    self._fail(self.vstart)
                    continue
                if not self.open:
                    self.begin_call(self.name)
                    self.emit_arguments("{")
                    self.open = True
                self.emit_arguments((", " if self.args else "") + json.dumps(self.keyword, ensure_ascii=False)
                                    + ": " + encoded)
                self.args += 1
                if text[end] == ")":
                    self._end_call()
                    self.pos, self.state = end + 1, AFTER
                else:
                    self.pos, self.state = end + 1, KEYWORD
            elif self.state == AFTER:     # "," and the next call, or the list's "]"
                if text.startswith(",", p):
                    self.pos, self.state = p + 1, NAME
                elif text.startswith("]", p):
                    self.pos, self.state = p + 1, TAIL
                else:
                    self._fail(p)
            elif self.state == TAIL:
                if text.startswith(PY_END, p):
                    self.pos = p + len(PY_END)
                elif not final and PY_END.startswith(text[p:]):
                    return
                else:
                    self.pos = p
                self.state = PLAIN
            else:   # PLAIN
                self.emit_content(text[self.pos:])
                self.pos = n
                return

    def _end_call(self) -> None:
        self.emit_arguments("}")
        self.open = False

    def _fail(self, pos: int) -> None:
        """Not (or no more) a list of calls: content from here (from the start when no call began)."""
        if self.open:
            self._end_call()
        self.pos = pos if self.calls else 0
        self.state = PLAIN

    def _scan(self, final: bool) -> int | None:
        """The end (a "," or ")" outside brackets and strings) of the value being read; None when
        it has not come yet, -1 when the value is broken. Resumes where it stopped."""
        text, n, i = self.text, len(self.text), self.scan
        while i < n:
            if self.quote:
                m = _STRING_RUN.match(text, i)
                if m is not None:
                    i = m.end()
                    continue
                if text[i] == "\\":
                    if i + 1 >= n:
                        break
                    i += 2
                elif text.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = ""
                elif len(self.quote) == 3 and not final and self.quote.startswith(text[i:]):
                    break   # maybe the closing triple quote
                else:
                    i += 1
                continue
            m = _PLAIN_RUN.match(text, i)
            if m is not None:
                i = m.end()
                continue
            c = text[i]
            if c in "'\"":
                if text.startswith(c * 3, i):
                    self.quote, i = c * 3, i + 3
                elif not final and (c * 3).startswith(text[i:]):
                    break   # "" or " at the end: maybe a triple quote
                else:
                    self.quote, i = c, i + 1
            elif c in "([{":
                self.depth += 1
                i += 1
            elif c in ")]}":
                if self.depth == 0:
                    if c == ")":
                        self.scan = i
                        return i
                    self.scan = i
                    return -1   # a bracket closed that the value did not open
                self.depth -= 1
                i += 1
            else:   # ","
                if self.depth == 0:
                    self.scan = i
                    return i
                i += 1
        self.scan = i
        return None
