"""One chat choice's text -> the assistant message's reasoning_content, content and tool_calls,
whole (`message()`) or as stream deltas (`add()` per piece of text, then `finish()`).

How tools are used (`ToolUse.mode`): "none" (text only), "auto" (the model's own tool-call
syntax, read by a tool parser), "required" (the grammar made the content a JSON array of
{"name", "parameters"}), "named" (the grammar made the content the named tool's arguments).
With a reasoning parser, only what follows the thinking is content. A harmony model's (gpt-oss)
output is parsed from its token ids instead (frontend/openai/harmony.py): its channels are
special tokens, which the text does not keep.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from frontend.openai.harmony import HarmonyOutput, parse_output
from frontend.openai.reasoning import ReasoningParser
from frontend.openai.tool_parsers import ToolCall, ToolParser, parsed_call


@dataclass
class ToolUse:
    mode: str = "none"                 # none | auto | required | named
    name: str | None = None            # the named tool
    parser: ToolParser | None = None   # auto


class ChatOutput:
    def __init__(self, tools: ToolUse, reasoning: ReasoningParser | None, harmony: bool = False):
        self.tools = tools
        self.reasoning = reasoning
        self.text = ""
        self.token_ids: list[int] = []   # (read by the harmony path only)
        self.harmony = HarmonyOutput() if harmony else None
        self._sent_reasoning = 0
        self._sent_content = 0
        self._named: ToolCall | None = None    # the named call, streamed as argument deltas
        self.tool_calls: list[ToolCall] = []
        self._stream = tools.parser.stream() if tools.mode == "auto" else None   # auto: the calls as they come
        self._fed = 0                          # how much of the content the tool stream has read
        if self._stream is not None:
            self.tool_calls = self._stream.calls

    def _parts(self, final: bool, streamed: bool = False) -> tuple[str, str]:
        if self.reasoning is None:
            return "", self.text
        reasoning, content = self.reasoning.split(self.text, final, streamed)
        return reasoning or "", content or ""

    # ------------------------------------------------------------ whole

    def message(self) -> dict:
        if self.harmony is not None:
            return self._harmony_message()
        reasoning, content = self._parts(final=True)
        msg: dict = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if self.tools.mode == "auto":   # one parse: the content outside the calls, and the calls
            outside, self.tool_calls = self.tools.parser.extract(content)
        else:
            outside, self.tool_calls = None, self._calls(content)
        if self.tool_calls:
            msg["content"] = outside
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    def _harmony_message(self) -> dict:
        reasoning, content, calls = parse_output(self.token_ids)
        msg: dict = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        self.tool_calls = calls if self.tools.mode == "auto" else []
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    def _calls(self, content: str) -> list[ToolCall]:
        mode = self.tools.mode
        if mode == "named":
            return [ToolCall(self.tools.name, content.strip())] if content.strip() else []
        if mode == "required":
            try:
                return [parsed_call(c["name"], c["parameters"]) for c in json.loads(content)]
            except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
                return []   # cut short (max_tokens): the text stays content
        return []

    # ------------------------------------------------------------ streamed

    def add(self, text: str, token_ids=()) -> dict:
        """The delta fields (reasoning_content, content, tool_calls) that `text` (its token ids)
        makes sendable."""
        self.text += text
        if self.harmony is not None:
            self.token_ids.extend(token_ids)
            return self._harmony_delta(self.harmony.add(token_ids))
        return self._delta(final=False)

    def _harmony_delta(self, delta: dict) -> dict:
        if self.tools.mode == "auto":
            self.tool_calls = self.harmony.calls.calls
        else:
            delta.pop("tool_calls", None)
        return delta

    def finish(self) -> dict:
        """The last delta: what was held back, and the tool calls parsed from the whole output."""
        if self.harmony is not None:
            return self._harmony_delta(self.harmony.finish())
        delta = self._delta(final=True)
        _, content = self._parts(final=True, streamed=True)
        mode = self.tools.mode
        if mode == "required":
            self.tool_calls = self._calls(content)
            if self.tool_calls:
                delta["tool_calls"] = [c.to_openai(i) for i, c in enumerate(self.tool_calls)]
            elif content[self._sent_content:]:
                delta["content"] = delta.get("content", "") + content[self._sent_content:]
                self._sent_content = len(content)
        return delta

    def _delta(self, final: bool) -> dict:
        reasoning, content = self._parts(final, streamed=final)
        delta: dict = {}
        if len(reasoning) > self._sent_reasoning:
            delta["reasoning_content"] = reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(reasoning)
        mode = self.tools.mode
        if mode == "named":
            self._named_delta(content, delta)
        elif mode == "auto":
            self._auto_delta(content, final, delta)
        elif mode != "required":   # required: the calls come whole at the end
            if len(content) > self._sent_content:
                delta["content"] = content[self._sent_content:]
                self._sent_content = len(content)
        return delta

    def _auto_delta(self, content: str, final: bool, delta: dict) -> None:
        """The tool parser's stream reads the new content: what of it is plain content, and
        the calls' deltas (each call's arguments as they come)."""
        new, self._fed = content[self._fed:], max(self._fed, len(content))
        step = self._stream.feed(new, final)
        if step.content:
            delta["content"] = step.content
        if step.tool_calls:
            delta["tool_calls"] = step.tool_calls

    def _named_delta(self, content: str, delta: dict) -> None:
        """The named tool's arguments stream as they are generated (OpenAI's tool_calls deltas)."""
        new = content[self._sent_content:]
        if not new:
            return
        self._sent_content = len(content)
        if self._named is None:
            self._named = ToolCall(self.tools.name, "")
            self.tool_calls = [self._named]
            call = self._named.to_openai(0)
            call["function"]["arguments"] = new
            delta["tool_calls"] = [call]
        else:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": new}}]
        self._named.arguments = content
