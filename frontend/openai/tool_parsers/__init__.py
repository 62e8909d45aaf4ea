"""Tool parsers: the model's own tool-call syntax -> OpenAI tool calls (tool_choice "auto",
`--enable-auto-tool-choice --tool-call-parser NAME`; vLLM's parser names)."""
from __future__ import annotations

from frontend.openai.tool_parsers.abstract import ToolCall, ToolParser, parsed_call
from frontend.openai.tool_parsers.gpt_oss import GptOssToolParser
from frontend.openai.tool_parsers.hermes import HermesToolParser
from frontend.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                             "gpt_oss": GptOssToolParser}

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "parsed_call"]
