"""gpt-oss's chat format, harmony, through the `openai-harmony` package (OpenAI's renderer and
parser; nothing here reads or writes harmony's tokens by hand).

    prompt:  OpenAI chat messages (+ tools, reasoning_effort) -> harmony Messages -> token ids
    output:  token ids -> harmony Messages by channel: analysis -> reasoning_content,
             final -> content, commentary addressed to `functions.NAME` -> tool_calls

A chat with a gpt-oss model (config.json's architectures naming GptOssForCausalLM, or `--reasoning-parser
openai_gptoss` / `--tool-call-parser gpt_oss`) goes this way in place of the chat template
and the text parsers: the channels are special tokens, which the detokenized text drops.

The package loads the o200k vocabulary at first use, downloading it (and checking its hash) when
it is not cached. Offline, put `o200k_base.tiktoken` in a directory and point
TIKTOKEN_ENCODINGS_BASE at it (or TIKTOKEN_RS_CACHE_DIR at a cache that holds it); without it
a harmony chat fails with HarmonyUnavailable saying so, and the server keeps serving the rest."""
from __future__ import annotations

import datetime
import json
import os

from frontend.openai.tool_parsers.abstract import ToolCall
from frontend.openai.tool_parsers.gpt_oss import HarmonyCalls

HARMONY_ARCHITECTURES = ("GptOssForCausalLM",)
REASONING_EFFORTS = ("low", "medium", "high")
_FUNCTIONS = "functions."


class HarmonyUnavailable(RuntimeError):
    """The harmony encoding could not be loaded (no network and no local o200k vocabulary)."""


_ENCODING = None


def encoding():
    """The gpt-oss harmony encoding, loaded once (lazily: importing this module costs nothing)."""
    global _ENCODING
    if _ENCODING is None:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
        try:
            _ENCODING = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as e:   # the package raises its own HarmonyError
            raise HarmonyUnavailable(
                f"the harmony chat format of gpt-oss needs the o200k_base vocabulary, which openai-harmony "
                f"could not load ({e}); offline, put o200k_base.tiktoken in a directory and set "
                f"TIKTOKEN_ENCODINGS_BASE to it") from None
    return _ENCODING


def is_harmony_model(model_dir: str) -> bool:
    """Whether the checkpoint's config.json names a model that speaks harmony (gpt-oss)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and any(a in HARMONY_ARCHITECTURES for a in cfg.get("architectures") or ())


def _text(content) -> str:
    """A message's content: a string, or the text of its parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def harmony_messages(messages: list[dict], tools: list[dict] | None = None,
                     reasoning_effort: str | None = None, today: str | None = None) -> list:
    """OpenAI chat messages -> harmony Messages, as vLLM and the gpt-oss chat template lay them
    out: a system message (reasoning effort, today's date), a developer message holding the
    system/developer messages' instructions and the function tools, then the turns. An
    assistant turn's reasoning_content is its analysis, its tool calls commentary to
    `functions.NAME` (JSON), its content the final answer; a tool result is a message from
    `functions.NAME` (found by its tool_call_id) to the assistant. ValueError on a role or a
    reasoning effort harmony has not."""
    from openai_harmony import (Author, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                                ToolDescription)
    effort = (reasoning_effort or "medium").lower()
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {reasoning_effort!r}")
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(today or datetime.date.today().isoformat())
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n".join(_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
    functions = [t.get("function", t) for t in tools or [] if t.get("type", "function") == "function"]
    if instructions or functions:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if functions:
            dev = dev.with_function_tools([ToolDescription.new(f["name"], f.get("description") or "",
                                                               f.get("parameters")) for f in functions])
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    names: dict[str, str] = {}   # tool_call_id -> function name
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(m.get("content"))))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            for call in m.get("tool_calls") or []:
                fn = call.get("function", {})
                names[call.get("id", "")] = fn.get("name", "")
                out.append(Message.from_role_and_content(Role.ASSISTANT, fn.get("arguments") or "{}")
                           .with_channel("commentary").with_recipient(_FUNCTIONS + fn.get("name", ""))
                           .with_content_type("json"))
            content = _text(m.get("content"))
            if content or not (reasoning or m.get("tool_calls")):
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id", ""), "")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, _FUNCTIONS + name),
                                                       _text(m.get("content")))
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise ValueError(f"harmony has no message role {role!r}")
    return out


def render_prompt(messages: list[dict], tools: list[dict] | None = None,
                  reasoning_effort: str | None = None) -> list[int]:
    """The prompt's token ids: the conversation, then the assistant's turn to answer."""
    from openai_harmony import Conversation, Role
    conv = Conversation.from_messages(harmony_messages(messages, tools, reasoning_effort))
    return list(encoding().render_conversation_for_completion(conv, Role.ASSISTANT))


def _is_call(msg) -> bool:
    return (msg.recipient or "").startswith(_FUNCTIONS)


def _message_text(msg) -> str:
    return "".join(getattr(c, "text", "") for c in msg.content)


def output_fields(messages: list) -> tuple[str | None, str | None, list[ToolCall]]:
    """Parsed output Messages -> (reasoning_content, content, tool calls): the analysis channel
    is reasoning; the final channel (and commentary to no one: a preamble) is content;
    commentary to `functions.NAME` is a call of NAME with the message as its JSON arguments
    (canonical JSON, read as the stream reads it: HarmonyCalls)."""
    reasoning, content = [], []
    calls = HarmonyCalls()
    for msg in messages:
        text = _message_text(msg)
        if _is_call(msg):
            calls.message(msg.recipient[len(_FUNCTIONS):])
            calls.feed(text)
            calls.end_message()
        elif msg.channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)
    return ("".join(reasoning) or None), ("".join(content) or None), calls.calls


class HarmonyOutput:
    """One choice's output tokens, parsed as they come (openai-harmony's StreamableParser):
    `add(token_ids)` gives the reasoning_content, content and tool_calls deltas they complete
    (a call's arguments stream as canonical JSON, HarmonyCalls); `finish` ends the last call."""

    def __init__(self):
        from openai_harmony import Role, StreamableParser
        self.parser = StreamableParser(encoding(), Role.ASSISTANT, strict=False)
        self.calls = HarmonyCalls()
        self._call_message = -1    # the index (among the parser's messages) of the call being read
        self._call_name: str | None = None   # its name, until its call begins (at its first text,
        # or at its message's end, or the output's)

    def add(self, token_ids) -> dict:
        from openai_harmony import StreamState
        reasoning, content, calls = [], [], []
        for t in token_ids:
            self.parser.process(t)
            done = len(self.parser.messages)
            if self._call_message >= 0 and done > self._call_message:   # the call's message ended
                self._begin_call()
                self.calls.end_message()
                self._call_message = -1
            recipient = self.parser.current_recipient or ""
            if (self._call_message < 0 and self.parser.state == StreamState.CONTENT
                    and recipient.startswith(_FUNCTIONS)):
                self._call_message, self._call_name = done, recipient[len(_FUNCTIONS):]
            delta = self.parser.last_content_delta
            if not delta:
                continue
            if self._call_message >= 0:
                self._begin_call()
                calls.extend(self.calls.feed(delta).tool_calls)
            else:
                (reasoning if self.parser.current_channel == "analysis" else content).append(delta)
        calls.extend(self.calls._take().tool_calls)
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = "".join(reasoning)
        if content:
            out["content"] = "".join(content)
        if calls:
            out["tool_calls"] = _merged(calls)
        return out

    def _begin_call(self) -> None:
        if self._call_name is not None:
            self.calls.message(self._call_name)
            self._call_name = None

    def messages(self) -> list:
        """Every message of the output, the parser told it ended. The last may have no end
        token (the engine stopped on it and left it out, or max_tokens cut the output short):
        it counts with what it has, as vLLM's harmony parsing keeps it."""
        from openai_harmony import Message, Role, StreamState
        partial = None
        if self.parser.state == StreamState.CONTENT and self.parser.current_content:
            partial = Message.from_role_and_content(self.parser.current_role or Role.ASSISTANT,
                                                    self.parser.current_content)
            partial.channel, partial.recipient = self.parser.current_channel, self.parser.current_recipient
        done = len(self.parser.messages)
        try:
            self.parser.process_eos()
        except Exception:   # an output cut inside a header: what was whole stands
            pass
        messages = self.parser.messages
        if partial is not None and len(messages) == done:   # (process_eos did not close it)
            messages.append(partial)
        return messages

    def finish(self) -> dict:
        """The last delta: the end of the open call's arguments (a call with no text yet counts:
        the end of the output ends its message, as messages() has it)."""
        self._begin_call()
        calls = self.calls.finish().tool_calls
        return {"tool_calls": _merged(calls)} if calls else {}


def _merged(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas, those of one call in a row joined."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            fn = out[-1]["function"]
            fn["arguments"] = fn.get("arguments", "") + d["function"].get("arguments", "")
        else:
            out.append(d)
    return out


def parse_output(token_ids) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole output's token ids -> (reasoning_content, content, tool calls)."""
    out = HarmonyOutput()
    out.add(token_ids)
    return output_fields(out.messages())
