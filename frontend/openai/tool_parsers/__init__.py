"""Tool parsers: the model's own tool-call syntax -> OpenAI tool calls (tool_choice "auto",
`--enable-auto-tool-choice --tool-call-parser NAME`; vLLM's parser names). Each is an
incremental state machine (abstract.ToolStream): streamed and whole results are the same for
any chunking, and a call's streamed arguments always join into valid JSON."""
from __future__ import annotations

from frontend.openai.tool_parsers.abstract import StreamDelta, ToolCall, ToolParser, ToolStream, parsed_call
from frontend.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from frontend.openai.tool_parsers.gpt_oss import GptOssToolParser
from frontend.openai.tool_parsers.hermes import HermesToolParser
from frontend.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from frontend.openai.tool_parsers.mistral import MistralToolParser
from frontend.openai.tool_parsers.pythonic import PythonicToolParser
from frontend.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "gpt_oss": GptOssToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "mistral": MistralToolParser, "pythonic": PythonicToolParser,
    "deepseek_v3": DeepSeekV3ToolParser}

__all__ = ["TOOL_PARSERS", "StreamDelta", "ToolCall", "ToolParser", "ToolStream", "parsed_call"]
