"""gpt_oss (gpt-oss): tool calls are harmony messages on the commentary channel addressed to
`functions.NAME`. Their markers are special tokens that the detokenized text drops, so they are
parsed from the output's token ids by openai-harmony (frontend/openai/harmony.py: ChatOutput takes
that path for a harmony model); selecting this parser on another model turns that path on. On
the text alone there is nothing to find: all of it is content."""
from __future__ import annotations

from frontend.openai.tool_parsers.abstract import ToolCall, ToolParser


class GptOssToolParser(ToolParser):
    harmony = True   # the calls come from the token ids (frontend/openai/harmony.py)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return text, []

    def plain_prefix(self, text: str, final: bool) -> str:
        return text
