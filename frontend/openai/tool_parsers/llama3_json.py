"""llama3_json (Llama 3.1/3.2 JSON tool calling): the whole output is one or more
{"name": ..., "parameters": {...}} objects separated by ";", optionally after <|python_tag|>."""
from __future__ import annotations

import json

from frontend.openai.tool_parsers.abstract import ToolCall, ToolParser, parsed_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, i = [], 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                name = obj["name"]
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]   # neither: not a call
                calls.append(parsed_call(name, args))
                while i < len(body) and body[i] in " \t\r\n;":
                    i += 1
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return text, []
        return None, calls

    def plain_prefix(self, text: str, final: bool) -> str:
        head = text.lstrip()
        if not head:
            return text if final else ""
        if head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            return ""   # a tool call (or its beginning): wait for the end
        return text
