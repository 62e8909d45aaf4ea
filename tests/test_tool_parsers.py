"""Tool parsers, reasoning parsers and the chat output assembly, on text (no server)."""
from __future__ import annotations

import json

import pytest

from frontend.openai.chat_output import ChatOutput, ToolUse
from frontend.openai.reasoning import REASONING_PARSERS
from frontend.openai.tool_parsers import TOOL_PARSERS


def test_hermes_extracts_calls_and_content():
    p = TOOL_PARSERS["hermes"]()
    text = ('I will look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    content, calls = p.extract(text)
    assert content == "I will look. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"}), ("add", {"a": 1})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert p.extract("no calls here") == ("no calls here", [])
    assert p.extract("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    # an unclosed block at the end (max_tokens after the JSON) still parses, as in vLLM
    assert p.extract('<tool_call>{"name": "f", "arguments": {}}')[1][0].name == "f"
    # arguments are always JSON (a string the model wrote becomes a JSON string, as vLLM's json.dumps);
    # a block without arguments is not a call
    assert p.extract('<tool_call>{"name": "f", "arguments": "str"}</tool_call>')[1][0].arguments == '"str"'
    assert p.extract('<tool_call>{"name": "f"}</tool_call>') == ('<tool_call>{"name": "f"}</tool_call>', [])
    # JSON nested past Python's recursion limit: read by the state machine (no recursion), a call
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    assert p.extract(deep)[1][0].arguments == "[" * 100_000 + "]" * 100_000
    assert p.extract("<tool_call>" + "[" * 100 + "</tool_call>") == ("<tool_call>" + "[" * 100 + "</tool_call>", [])
    # a lone surrogate escape is valid JSON but no UTF-8 response can carry it (it was a 500): it
    # reads as U+FFFD (the arguments stream as they come, so it cannot turn the call into content)
    for lone, name, args in (('<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>', "f", {"x": "\ufffd"}),
                             ('<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>', "\ufffd", {})):
        [call] = p.extract(lone)[1]
        assert (call.name, json.loads(call.arguments)) == (name, args)
        (call.name + call.arguments).encode()
    assert json.loads(p.extract('<tool_call>{"name": "f", "arguments": {"x": "\\ud83d\\ude00"}}</tool_call>')[1][0]
                      .arguments) == {"x": "\U0001f600"}   # a pair is one character



def test_hermes_streaming_holds_back_the_marker():
    p = TOOL_PARSERS["hermes"]()
    s = p.stream()
    assert s.feed("Hello <tool").content == "Hello "
    assert s.feed("_call>{").content == "" and not s.calls
    s = p.stream()
    assert s.feed("Hello <b>").content == "Hello <b>"
    s = p.stream()
    assert s.feed("Hello <tool").content == "Hello " and s.finish().content == "<tool"


def test_llama3_json():
    p = TOOL_PARSERS["llama3_json"]()
    content, calls = p.extract('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert p.extract("Just text.") == ("Just text.", [])
    assert p.extract('{"not a call": 1}') == ('{"not a call": 1}', [])
    assert p.extract('{"name": "f"}') == ('{"name": "f"}', [])   # neither parameters nor arguments
    assert p.extract('{"name": "f", "parameters": "x"}')[1][0].arguments == '"x"'
    s = p.stream()
    assert s.feed('{"name"').content == "" and p.stream().feed("Hi").content == "Hi"
    deep = '{"name": "f", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert p.extract(deep)[1][0].arguments == "[" * 100_000 + "]" * 100_000
    lone = '{"name": "f", "parameters": {"x": "\\ud800"}}'
    assert json.loads(p.extract(lone)[1][0].arguments) == {"x": "\ufffd"}


@pytest.mark.parametrize("name,text,expected", [
    ("qwen3", "<think>\nhmm\n</think>\n\nAnswer", ("\nhmm\n", "\n\nAnswer")),
    ("qwen3", "Answer only", (None, "Answer only")),
    ("deepseek_r1", "hmm</think>Answer", ("hmm", "Answer")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),
])
def test_reasoning_split(name, text, expected):
    assert REASONING_PARSERS[name]().split(text, final=True) == expected


def joined_calls(deltas: list[dict]) -> list[dict]:
    """OpenAI's streamed tool_calls deltas joined per index, as a client does: [{name, arguments}]."""
    calls: dict[int, dict] = {}
    for d in deltas:
        fn = d.get("function") or {}
        call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
        if d.get("id"):
            assert call["name"] is None, "a call's header came twice"
            call["name"] = fn["name"]
        call["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def _stream(out: ChatOutput, text: str, step: int = 3) -> dict:
    """Feed text in pieces; the deltas joined per field."""
    got: dict = {"reasoning_content": "", "content": "", "tool_calls": []}

    def take(delta):
        for k, v in delta.items():
            if k == "tool_calls":
                got[k].extend(v)
            else:
                got[k] += v
    for i in range(0, len(text), step):
        take(out.add(text[i:i + step]))
    take(out.finish())
    return got


@pytest.mark.parametrize("step", [1, 3, 100])
def test_unclosed_thinking_streams_once(step):
    """qwen3, an output cut inside its thinking: the stream sends it as reasoning and not again as
    content at the end (it sent both); the whole answer has it as content (vLLM does both so)."""
    text = "<think>Let me see, the answer is"
    got = _stream(ChatOutput(ToolUse("none"), REASONING_PARSERS["qwen3"]()), text, step)
    assert (got["reasoning_content"], got["content"]) == ("Let me see, the answer is", "")
    whole = ChatOutput(ToolUse("none"), REASONING_PARSERS["qwen3"]())
    whole.text = text
    assert whole.message()["content"] == text and "reasoning_content" not in whole.message()


@pytest.mark.parametrize("step", [1, 3, 8, 100])
@pytest.mark.parametrize("text", ["I think</think>answer", "x</think>", "plain answer", "a</thi", "<thi"])
@pytest.mark.parametrize("prompt", [None, "open"])
def test_qwen3_stream_adds_up_to_the_whole_message(text, prompt, step):
    """qwen3 on an output with no opening <think>: it streamed the text as content, then again as
    reasoning at </think>, and lost the answer. Now the stream adds up to the whole message: all
    content when the output did not open the thinking, reasoning up to </think> when the prompt
    opened it (Qwen3-*-Thinking-2507's template)."""
    from frontend.openai.reasoning import reasoning_after_prompt
    parser = reasoning_after_prompt(REASONING_PARSERS["qwen3"](), prompt)
    whole = ChatOutput(ToolUse("none"), parser)
    whole.text = text
    msg = whole.message()
    got = _stream(ChatOutput(ToolUse("none"), parser), text, step)
    assert (got["reasoning_content"], got["content"]) == (msg.get("reasoning_content", ""), msg["content"] or "")
    if prompt == "open" and "</think>" in text:
        assert (msg["reasoning_content"], msg["content"]) == tuple(text.split("</think>"))
    elif prompt is None:
        assert msg["content"] == text


def test_required_tool_call_with_a_lone_surrogate_stays_content():
    out = ChatOutput(ToolUse("required"), None)
    out.text = '[{"name": "f", "parameters": {"x": "\\ud800"}}]'
    assert out.message() == {"role": "assistant", "content": out.text}


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_streamed_reasoning_and_tool_calls_equal_the_whole_message(step):
    text = ('<think>Should I call? Yes.</think>Calling now. <tool_call>{"name": "add", "arguments": {"a": 1, '
            '"b": true}}</tool_call>')
    whole = ChatOutput(ToolUse("auto", parser=TOOL_PARSERS["hermes"]()), REASONING_PARSERS["qwen3"]())
    whole.text = text
    msg = whole.message()
    got = _stream(ChatOutput(ToolUse("auto", parser=TOOL_PARSERS["hermes"]()), REASONING_PARSERS["qwen3"]()), text,
                  step)
    assert msg["reasoning_content"] == got["reasoning_content"] == "Should I call? Yes."
    assert msg["content"] == got["content"] == "Calling now. "
    assert [c["function"] for c in msg["tool_calls"]] == joined_calls(got["tool_calls"])
    assert got["tool_calls"][0]["index"] == 0 and got["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert len(got["tool_calls"]) > 2 or step == 100   # the arguments stream (in pieces), not whole at the end


def test_required_and_named_outputs():
    out = ChatOutput(ToolUse("required"), None)
    out.text = '[{"name": "add", "parameters": {"a": 1, "b": false}}, {"name": "f", "parameters": {}}]'
    msg = out.message()
    assert msg["content"] is None and [c["function"]["name"] for c in msg["tool_calls"]] == ["add", "f"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": False}
    deep = ChatOutput(ToolUse("required"), None)
    deep.text = "[" * 100_000 + "]" * 100_000  # nested past the recursion limit: cut short, not a 500
    assert "tool_calls" not in deep.message()
    named = ChatOutput(ToolUse("named", name="add"), None)
    got = _stream(named, '{"a": 1, "b": true}', 4)
    assert got["content"] == "" and len({c.get("id") for c in got["tool_calls"]} - {None}) == 1
    assert "".join(c["function"]["arguments"] for c in got["tool_calls"]) == '{"a": 1, "b": true}'
    assert got["tool_calls"][0]["function"]["name"] == "add"


# ------------------------------------------------------------------ through the API server (scripted engine)

class _ScriptedLLM:
    """Stands in for AsyncLLM: every request's output is SCRIPT, one character per token."""
    SCRIPT = ('<think>Weather needs a tool.</think>Checking. <tool_call>{"name": "get_weather", '
              '"arguments": {"city": "Rome"}}</tool_call>')

    def __init__(self, **config):
        from ipc.config import EngineConfig
        from tests.test_api_server import FakeTokenizer
        self.config = EngineConfig(model="fake", max_model_len=4096, vocab_size=1000, **config)
        self.tokenizer = FakeTokenizer()
        self.client_index = 0
        self.dead_reason = None
        self.is_dead = False

    async def generate(self, prompt_token_ids, params, request_id, **options):
        from frontend.outputs import CompletionOutput, RequestOutput
        for i, ch in enumerate(self.SCRIPT):
            last = i == len(self.SCRIPT) - 1
            yield RequestOutput(request_id, None, prompt_token_ids,
                                [CompletionOutput(0, ch, [ord(ch) % 1000], "stop" if last else None)], finished=last)

    async def abort(self, request_id):
        pass


def test_reasoning_and_auto_tool_calls_through_the_api_server():
    """--reasoning-parser qwen3 with --tool-call-parser hermes: reasoning_content, content and
    tool_calls, whole and streamed (OpenAI's deltas), and the invocation counter."""
    from tests.conftest import run_fake
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "fake", "messages": [{"role": "user", "content": "weather?"}], "tools": tools}

    async def scenario(session, url, llm):
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
        deltas = []
        async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    deltas.append(json.loads(line[6:]))
        async with session.get(url + "/metrics") as r:
            metrics = await r.text()
        return whole, deltas, metrics

    whole, deltas, metrics = run_fake(_ScriptedLLM(reasoning_parser="qwen3", enable_auto_tool_choice=True,
                                                   tool_call_parser="hermes"), scenario)
    [choice] = whole["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == "Weather needs a tool." and msg["content"] == "Checking. "
    [call] = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    got = {"reasoning_content": "", "content": "", "tool_calls": []}
    finish = None
    for d in deltas:
        for c in d["choices"]:
            finish = c["finish_reason"] or finish
            for k in got:
                v = c["delta"].get(k)
                if v:
                    got[k] = got[k] + v
    assert finish == "tool_calls"
    assert got["reasoning_content"] == msg["reasoning_content"] and got["content"] == msg["content"]
    assert joined_calls(got["tool_calls"]) == [call["function"]]
    assert 'vllm:tool_call_parser_invocations_total{' in metrics


class _ScriptedArguments(_ScriptedLLM):
    SCRIPT = '{"city": "Rome"}'


def _whole_and_streamed(llm, body: dict) -> tuple[dict, list[dict]]:
    """A chat completion through the API server over `llm`, whole and streamed (its chunks)."""
    from tests.conftest import run_fake

    async def scenario(session, url, llm):
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
        async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            deltas = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        return whole, deltas
    return run_fake(llm, scenario)


def test_a_prompt_that_closed_the_thinking_makes_a_constrained_output_content():
    """--reasoning-parser deepseek_r1 reads an output without </think> as reasoning. But when the
    prompt closed the thinking, the engine constrains the output from its first token (as vLLM):
    a named tool's arguments are then the answer, whole and streamed (they came back as
    reasoning_content, and the call was lost)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    body = {"model": "fake", "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "<think>ok</think>"}],
            "continue_final_message": True, "add_generation_prompt": False}

    whole, deltas = _whole_and_streamed(_ScriptedArguments(reasoning_parser="deepseek_r1"), body)
    msg = whole["choices"][0]["message"]
    assert "reasoning_content" not in msg or not msg["reasoning_content"], msg
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    streamed = [c for d in deltas for ch in d["choices"] for c in ch["delta"].get("tool_calls") or []]
    assert "".join(c["function"].get("arguments", "") for c in streamed) == '{"city": "Rome"}'
    assert not any(ch["delta"].get("reasoning_content") for d in deltas for ch in d["choices"])


def test_a_prompt_that_opened_the_thinking_makes_the_output_reasoning():
    """--reasoning-parser qwen3 when the template opened <think> in the prompt (Qwen3-*-Thinking-2507):
    the output starts inside the thinking, so up to </think> it is reasoning, whole and streamed
    alike (here the output never closes it)."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "weather?"},
                                          {"role": "assistant", "content": "<think>"}],
            "continue_final_message": True, "add_generation_prompt": False}

    whole, deltas = _whole_and_streamed(_ScriptedArguments(reasoning_parser="qwen3"), body)
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] == _ScriptedArguments.SCRIPT and not msg["content"], msg
    streamed = "".join(ch["delta"].get("reasoning_content") or "" for d in deltas for ch in d["choices"])
    assert streamed == _ScriptedArguments.SCRIPT
    assert not any(ch["delta"].get("content") for d in deltas for ch in d["choices"])


class _ScriptedQwen3Coder(_ScriptedLLM):
    SCRIPT = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome {\"x\"}\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_through_the_api_server_types_parameters_by_the_tools_schema():
    """--tool-call-parser qwen3_coder: the request's tools reach the parser (days is an integer by
    the schema, city a string), whole and streamed alike, the arguments streamed in pieces."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    body = {"model": "fake", "messages": [{"role": "user", "content": "weather?"}], "tools": tools}
    whole, chunks = _whole_and_streamed(_ScriptedQwen3Coder(enable_auto_tool_choice=True,
                                                            tool_call_parser="qwen3_coder"), body)
    msg = whole["choices"][0]["message"]
    assert msg["content"] == "Checking.\n" and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in msg["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Rome {\\"x\\"}", "days": 3}'}]
    deltas = [c for d in chunks for ch in d["choices"] for c in ch["delta"].get("tool_calls") or []]
    assert joined_calls(deltas) == [c["function"] for c in msg["tool_calls"]] and len(deltas) > 3
    assert "".join(ch["delta"].get("content") or "" for d in chunks for ch in d["choices"]) == msg["content"]
