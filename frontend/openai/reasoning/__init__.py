"""Reasoning parsers: the model's thinking (<think>...</think>) -> reasoning_content
(`--reasoning-parser NAME`; vLLM's names)."""
from __future__ import annotations

from frontend.openai.tool_parsers.abstract import held_prefix


class ReasoningParser:
    """Splits an output into (reasoning, content). `split(text, final=False)` may be called on an
    output still growing: it holds back an end that could still become a tag."""
    start = "<think>"
    end = "</think>"
    # with no </think> in a finished output: all reasoning (deepseek_r1) or all content (qwen3)
    unclosed_is_reasoning = True

    def split(self, text: str, final: bool, streamed: bool = False) -> tuple[str | None, str | None]:
        """streamed (with final): the end of a stream, which sent an opened, unclosed thinking as
        reasoning while it grew: it stays reasoning (vLLM streams it so too; its whole answer
        makes it content, as `final` alone does here)."""
        if not self.unclosed_is_reasoning:
            body = text.lstrip()
            if not body.startswith(self.start):
                if not final and self.start.startswith(body):
                    return None, None   # maybe the start of <think>: wait
                # not thinking: all of it is the answer, a stray </think> too (a stream has sent it
                # as content by then; a prompt that opened the thinking takes another parser)
                return None, text
        i = text.find(self.end)
        if i >= 0:
            reasoning = text[:i]
            j = reasoning.find(self.start)
            if j >= 0 and not reasoning[:j].strip():
                reasoning = reasoning[j + len(self.start):]
            return reasoning, text[i + len(self.end):]
        # no </think> yet; qwen3 gets here only with the output opening <think>
        body = text.lstrip()
        opened = body.startswith(self.start)
        if final:
            if self.unclosed_is_reasoning or streamed:
                return (body[len(self.start):] if opened else text), None
            return None, text
        if opened:
            return held_prefix(body[len(self.start):], self.end), None
        if self.start.startswith(body):
            return None, None          # maybe the start of <think>: wait
        return held_prefix(text, self.end), None


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 opens with <think> itself when thinking (and not at all with enable_thinking=False)."""
    unclosed_is_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1's template opens <think> in the prompt: the output starts inside the thinking."""
    unclosed_is_reasoning = True


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (vLLM's openai_gptoss): the thinking is harmony's analysis channel, whose markers
    are special tokens the text drops; it is parsed from the token ids by openai-harmony
    (frontend/openai/harmony.py), and selecting this parser turns that path on. On the text
    alone there is no thinking to find: all of it is content."""
    harmony = True

    def split(self, text: str, final: bool, streamed: bool = False) -> tuple[str | None, str | None]:
        return None, text


def reasoning_after_prompt(parser: ReasoningParser | None, prompt_thinking: str | None) -> ReasoningParser | None:
    """The parser of an output whose prompt left its thinking `prompt_thinking`: "open" (the
    template opened <think>, as Qwen3-*-Thinking-2507's do): the output starts inside it, so
    all of it is reasoning up to </think>, whoever's the parser; "closed" or None: `parser`."""
    if parser is not None and prompt_thinking == "open":
        return DeepSeekR1ReasoningParser()
    return parser


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3ReasoningParser,
                                                       "deepseek_r1": DeepSeekR1ReasoningParser,
                                                       "openai_gptoss": GptOssReasoningParser}
