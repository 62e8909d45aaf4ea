"""hermes (Qwen2.5, Qwen3, Hermes): <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one
block per call, content before the first block."""
from __future__ import annotations

import json
import re

from frontend.openai.tool_parsers.abstract import ToolCall, ToolParser, held_prefix, parsed_call

START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if START not in text:
            return text, []
        calls = []
        try:
            for closed, unclosed in _BLOCK.findall(text):
                body = (closed or unclosed).strip()
                if not body:
                    continue
                obj = json.loads(body)
                name, args = obj["name"], obj["arguments"]   # no arguments: not a call (vLLM)
                calls.append(parsed_call(name, args))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return text, []   # not a well-formed call: the text stays content (as vLLM)
        content = text[:text.find(START)]
        return (content if content.strip() else None), calls

    def plain_prefix(self, text: str, final: bool) -> str:
        return text if final and START not in text else held_prefix(text, START)
