"""The APIs coding agents speak, through a real `loom serve` and the official clients: OpenAI's
Responses API (`client.responses`) and Anthropic's Messages API (`anthropic.Anthropic().messages`).

Both are translations into the one chat path, so the oracle is /v1/chat/completions on the same
server: the same greedy request gives the same text and the same prompt tokens. Streamed and
non-streamed answers are the same, and every bad input gets a 4xx in the API's own error shape.

One server for the module: the tiny random model with a Qwen-like chat template (tools, tool
calls and results; the thinking opened by enable_thinking, else closed in the prompt), the hermes
tool parser, the qwen3 reasoning parser and an API key (the anthropic client sends it as
x-api-key). The random model writes garbage unless a grammar holds it (from the first token
when the prompt closed the thinking), so tool calls are asked for by name or as required.
What a random model never writes (thinking, then text, then a hermes tool call; an engine that
breaks mid-stream) comes from a scripted engine under the real API server, in-process."""
from __future__ import annotations

import json
import os
import shutil
import time

import anthropic
import jsonschema
import openai
import pytest
import requests

from tests.conftest import run_fake, running_server
from tests.test_tool_parsers import _ScriptedLLM

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}"
    "{%- if m.role == 'tool' %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")

KEY = "sekrit"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
ASK = "Tell me a story about a cat."


@pytest.fixture(scope="module")
def model_dir(model_factory, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("agent-apis-model"))
    src = model_factory("qwen3")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f)
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--max-model-len", "512", "--api-key", KEY, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def chat(oai, model, messages, **kw):
    """The oracle: the same request through /v1/chat/completions."""
    return oai.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def strip_ids(obj):
    """An answer without what differs between two runs of one request: ids and times."""
    if isinstance(obj, dict):
        return {k: strip_ids(v) for k, v in obj.items() if k not in ("id", "call_id", "created_at")}
    if isinstance(obj, list):
        return [strip_ids(v) for v in obj]
    return obj


# ======================================================================= Responses API

def test_responses_plain_is_the_chat_answer(oai, model):
    r = oai.responses.create(model=model, input=ASK, instructions="Be brief.", max_output_tokens=8, temperature=0)
    c = chat(oai, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}], max_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"   # 8 tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 8


def test_responses_stream_consolidates_into_the_whole_response(oai, model):
    """OpenAI's event order with sequence numbers; the deltas add up to one message, and
    response.completed's response is the non-streamed one (seed #34188)."""
    kw = dict(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
              max_output_tokens=12, temperature=0)
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert strip_ids(final.model_dump()["output"]) == strip_ids(whole.model_dump()["output"])
    assert final.usage == whole.usage and final.status == whole.status
    assert events[-2].item.id == events[2].item.id == final.output[0].id   # one message item, one id


def test_responses_function_call_round_trip(oai, model):
    """A named tool's call (the grammar holds its arguments), streamed and whole alike; then its
    function_call_output continues the conversation as the chat's tool message does."""
    tools = [{"type": "function", "name": "get_weather", "description": "weather of a city", "parameters": WEATHER}]
    kw = dict(model=model, input="What is the weather in Rome?", tools=tools, temperature=0, max_output_tokens=200,
              tool_choice={"type": "function", "name": "get_weather"})
    r = oai.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(oai.responses.create(stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and done.name == "get_weather"
    assert strip_ids(events[-1].response.model_dump()["output"]) == strip_ids(r.model_dump()["output"])
    with oai.responses.stream(**kw) as s:   # the client's own accumulation of the events
        [acc] = s.get_final_response().output
    assert (acc.type, acc.name, acc.arguments, acc.status) == ("function_call", call.name, call.arguments, "completed")

    follow = [{"role": "user", "content": "What is the weather in Rome?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    r2 = oai.responses.create(model=model, input=follow, tools=tools, tool_choice="none", temperature=0,
                              max_output_tokens=8)
    c = chat(oai, model, [{"role": "user", "content": "What is the weather in Rome?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
             tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
             tool_choice="none", max_tokens=8)
    assert r2.output_text == c.choices[0].message.content and r2.usage.input_tokens == c.usage.prompt_tokens

    required = oai.responses.create(**{**kw, "tool_choice": "required", "max_output_tokens": 300})
    assert [o.type for o in required.output] == ["function_call"] and required.output[0].name == "get_weather"


def test_responses_text_format_json_schema(oai, model):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    r = oai.responses.create(model=model, input=ASK, text={"format": fmt}, temperature=1.0, max_output_tokens=200)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_responses_store_previous_response_id_and_get(oai, model, server):
    first = oai.responses.create(model=model, input=ASK, max_output_tokens=6, temperature=0)
    assert first.store
    got = oai.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    second = oai.responses.create(model=model, input="And then?", previous_response_id=first.id,
                                  max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    c = chat(oai, model, [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And then?"}], max_tokens=6)
    assert second.output_text == c.choices[0].message.content and second.usage.input_tokens == c.usage.prompt_tokens
    # streamed responses are stored too
    events = list(oai.responses.create(model=model, input=ASK, max_output_tokens=4, temperature=0, stream=True))
    assert oai.responses.retrieve(events[-1].response.id).model_dump() == events[-1].response.model_dump()
    unstored = oai.responses.create(model=model, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_responses_background_and_cancel(oai, model):
    done = oai.responses.create(model=model, input=ASK, max_output_tokens=4, temperature=0, background=True)
    assert done.status == "queued" and done.background
    deadline = time.monotonic() + 60
    while oai.responses.retrieve(done.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    got = oai.responses.retrieve(done.id)
    assert got.status == "incomplete" and got.usage.output_tokens == 4
    long = oai.responses.create(model=model, input=ASK, max_output_tokens=450, temperature=0, background=True)
    cancelled = oai.responses.cancel(long.id)
    assert cancelled.status == "cancelled", cancelled.status
    assert oai.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):   # only background responses can be cancelled
        oai.responses.cancel(oai.responses.create(model=model, input=ASK, max_output_tokens=1).id)


def test_responses_bad_input_is_a_400_and_the_server_keeps_serving(oai, model, server):
    bad = [dict(input=5), dict(input=[{"type": "bogus"}]), dict(input="x", tools=[{"type": "web_search"}]),
           dict(input="x", text={"format": {"type": "xml"}}), dict(input="x", max_output_tokens=-1),
           dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
           dict(input="x", tool_choice="required")]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=model, **kw)
        assert e.value.status_code == 400 and e.value.body["message"], kw
    with pytest.raises(openai.BadRequestError) as e:   # named as the client spells it
        oai.responses.create(model=model, input="x", max_output_tokens=100_000)
    assert e.value.body["param"] == "max_output_tokens" and "max_output_tokens" in e.value.body["message"]
    r = requests.post(server.url + "/v1/responses", data=b"{", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert oai.responses.create(model=model, input=ASK, max_output_tokens=2).status == "incomplete"


# ======================================================================= Messages API (Anthropic's)

GREEDY = {"temperature": 0}   # (this anthropic client has no temperature argument: sent as an extra field)


def messages(claude, model, **kw):
    return claude.messages.create(model=model, extra_body=GREEDY, **kw)


def streamed(claude, model, **kw):
    """(the stream's events, its final message as the client accumulated it)."""
    with claude.messages.stream(model=model, extra_body=GREEDY, **kw) as s:
        events = list(s)
        return events, s.get_final_message()


def same_message(a, b) -> bool:
    keep = ("content", "stop_reason", "stop_sequence", "role", "type", "model")
    da, db = a.model_dump(), b.model_dump()
    blocks = lambda d: [{k: v for k, v in x.items() if k not in ("id", "parsed_output")} for x in d["content"]]
    return ({k: da[k] for k in keep if k != "content"} == {k: db[k] for k in keep if k != "content"}
            and blocks(da) == blocks(db)
            and (a.usage.input_tokens, a.usage.output_tokens) == (b.usage.input_tokens, b.usage.output_tokens))


def test_messages_text_is_the_chat_answer_streamed_or_not(claude, oai, model):
    kw = dict(max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": ASK}])
    m = messages(claude, model, **kw)
    c = chat(oai, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}], max_tokens=8)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    [block] = m.content
    assert block.type == "text" and block.text == c.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    events, final = streamed(claude, model, **kw)
    assert same_message(final, m)
    # system as text blocks: the same prompt
    blocks = messages(claude, model, **{**kw, "system": [{"type": "text", "text": "Be brief."}]})
    assert same_message(blocks, m)


def test_messages_stream_event_order(claude, model, server):
    """Anthropic's order, raw off the wire: message_start, (ping), per block start / deltas / stop,
    message_delta with stop_reason and usage, message_stop."""
    body = {"model": model, "max_tokens": 6, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": ASK}]}
    r = requests.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY, "anthropic-version":
                                                                       "2023-06-01"}, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    names, datas = [], []
    for line in r.iter_lines():
        if line.startswith(b"event: "):
            names.append(line[7:].decode())
        elif line.startswith(b"data: "):
            datas.append(json.loads(line[6:]))
    assert [d["type"] for d in datas] == names
    names = [n for n in names if n != "ping"]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = datas[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = [d for d in datas if d["type"] == "message_delta"][0]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 6


def test_messages_tool_use_round_trip(claude, oai, model):
    tools = [{"name": "get_weather", "description": "weather of a city", "input_schema": WEATHER}]
    ask = {"role": "user", "content": "What is the weather in Rome?"}
    kw = dict(max_tokens=200, tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, messages=[ask])
    m = messages(claude, model, **kw)
    [use] = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    assert m.stop_reason == "tool_use"
    events, final = streamed(claude, model, **kw)
    assert same_message(final, m)
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)

    follow = [ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                      "input": use.input}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    m2 = messages(claude, model, max_tokens=8, tools=tools, tool_choice={"type": "none"}, messages=follow)
    c = chat(oai, model, [{"role": "user", "content": "What is the weather in Rome?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": use.id, "type": "function",
                               "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                          {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"}],
             tools=[{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                      "parameters": WEATHER}}], tool_choice="none", max_tokens=8)
    assert [b.type for b in m2.content] == ["text"] and m2.content[0].text == c.choices[0].message.content
    assert m2.usage.input_tokens == c.usage.prompt_tokens
    # "any": some tool must be called
    anyone = messages(claude, model, **{**kw, "max_tokens": 300, "tool_choice": {"type": "any"}})
    assert [b.type for b in anyone.content] == ["tool_use"] and anyone.stop_reason == "tool_use"


def test_messages_thinking_blocks(claude, model):
    """thinking enabled: the template opens <think>, so the reasoning parser reads the answer as
    thinking; streamed as thinking_delta, and the same message."""
    kw = dict(max_tokens=10, thinking={"type": "enabled", "budget_tokens": 1024}, messages=[{"role": "user",
                                                                                           "content": ASK}])
    m = messages(claude, model, **kw)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
    events, final = streamed(claude, model, **kw)
    assert same_message(final, m)
    assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta" for e in events)
    off = messages(claude, model, **{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]


def test_messages_stop_sequences_and_prefill(claude, oai, model):
    base = messages(claude, model, max_tokens=12, messages=[{"role": "user", "content": ASK}]).content[0].text
    stop = base[4:6]
    m = messages(claude, model, max_tokens=12, stop_sequences=[stop], messages=[{"role": "user", "content": ASK}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == base[:base.index(stop)]
    # a last assistant message is continued (Anthropic's prefill): the answer is what follows it
    convo = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "Once upon a"}]
    pre = messages(claude, model, max_tokens=4, messages=convo)
    c = chat(oai, model, convo, max_tokens=4, extra_body={"add_generation_prompt": False,
                                                          "continue_final_message": True})
    assert pre.content[0].text == c.choices[0].message.content and pre.usage.input_tokens == c.usage.prompt_tokens


def test_messages_count_tokens(claude, model):
    kw = dict(system="Be brief.", messages=[{"role": "user", "content": ASK}],
              tools=[{"name": "get_weather", "input_schema": WEATHER}], tool_choice={"type": "tool",
                                                                                      "name": "get_weather"})
    counted = claude.messages.count_tokens(model=model, **kw).input_tokens
    assert counted == messages(claude, model, max_tokens=1, **kw).usage.input_tokens
    assert counted > claude.messages.count_tokens(model=model, messages=kw["messages"]).input_tokens


def test_messages_errors_in_anthropics_shape(claude, model, server):
    for kw in (dict(max_tokens=8, messages=[{"role": "bogus", "content": "x"}]),
               dict(max_tokens=8, messages=[]),
               dict(max_tokens=-1, messages=[{"role": "user", "content": "x"}]),
               dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
               dict(max_tokens=8, messages=[{"role": "user", "content": "x"}], tool_choice={"type": "sometimes"}),
               dict(max_tokens=8, messages=[{"role": "user", "content": [
                   {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=model, **kw)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error", kw
    r = requests.post(server.url + "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]},
                      headers={"x-api-key": KEY}, timeout=10)   # max_tokens is required
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                        "message": e.value.body["error"]["message"]}}
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    assert messages(claude, model, max_tokens=2, messages=[{"role": "user", "content": "x"}]).usage.output_tokens == 2


# ======================================================================= reasoning and auto tool calls (scripted)

def _scripted_answers(path: str, body: dict) -> tuple[dict, list[dict]]:
    """`body` through the API server over a scripted engine (its output: thinking, text, then a
    hermes tool call), whole and streamed (the stream's events, in order)."""
    async def scenario(session, url, llm):
        async with session.post(url + path, json=body) as r:
            assert r.status == 200, await r.text()
            whole = await r.json()
        async with session.post(url + path, json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        return whole, events
    return run_fake(_ScriptedLLM(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes"),
                    scenario)


SCRIPTED_TOOL = {"name": "get_weather", "parameters": {"type": "object"}}


def test_responses_reasoning_text_and_auto_tool_call_items():
    whole, events = _scripted_answers("/v1/responses", {"model": "fake", "input": "weather?",
                                                        "tools": [{"type": "function", **SCRIPTED_TOOL}]})
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Weather needs a tool."}]
    assert message["content"][0]["text"] == "Checking. "
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Rome"})
    types = [e["type"] for e in events]
    squeeze = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]   # runs of deltas as one
    assert squeeze == ["response.created", "response.in_progress",
                       "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                       "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                       "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                       "response.output_text.done", "response.content_part.done", "response.output_item.done",
                       "response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert strip_ids(events[-1]["response"]["output"]) == strip_ids(whole["output"])


def test_messages_thinking_text_and_auto_tool_use_blocks():
    body = {"model": "fake", "max_tokens": 100, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    whole, events = _scripted_answers("/v1/messages", body)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][0]["thinking"] == "Weather needs a tool." and whole["content"][1]["text"] == "Checking. "
    assert whole["content"][2]["input"] == {"city": "Rome"} and whole["stop_reason"] == "tool_use"
    # the events rebuild the message, block by block, in Anthropic's order
    blocks: list[dict] = []
    order = []
    for e in events:
        order.append(e["type"])
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"], partial=""))
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "partial"}[d["type"]]
            b[key] += d.get(key, d.get("partial_json", ""))
        elif e["type"] == "message_delta":
            assert e["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert order[0] == "message_start" and order[-2:] == ["message_delta", "message_stop"]
    assert order.count("content_block_start") == order.count("content_block_stop") == 3
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["partial"])
        del b["partial"]
    assert strip_ids(blocks) == strip_ids(whole["content"])


class _FailingLLM(_ScriptedLLM):
    """A scripted engine whose stream breaks after a few tokens (mid-stream errors)."""

    async def generate(self, prompt_token_ids, params, request_id, **options):
        n = 0
        async for out in super().generate(prompt_token_ids, params, request_id):
            yield out
            n += 1
            if n == 3:
                raise RuntimeError("the engine broke")


def test_a_mid_stream_error_is_each_apis_own_error_event():
    async def scenario(session, url, llm):
        got = {}
        for path, body in (("/v1/messages", {"max_tokens": 50, "messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/responses", {"input": "x"})):
            async with session.post(url + path, json={**body, "stream": True}) as r:
                got[path] = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        async with session.post(url + "/v1/messages", json={"max_tokens": 5, "messages": [
                {"role": "user", "content": "x"}]}) as r:
            got["whole"] = (r.status, await r.json())
        return got

    got = run_fake(_FailingLLM(), scenario)
    last = got["/v1/messages"][-1]
    assert last["type"] == "error" and last["error"]["type"] == "api_error"
    assert [e["type"] for e in got["/v1/messages"][:2]] == ["message_start", "ping"]
    last = got["/v1/responses"][-1]
    assert last["type"] == "error" and last["code"] == "500" and last["message"]
    assert got["/v1/responses"][0]["type"] == "response.created"
    status, body = got["whole"]
    assert status == 500 and body["type"] == "error" and body["error"]["type"] == "api_error"


# ======================================================================= the translations alone

def test_responses_items_become_chat_messages():
    from frontend.openai.responses import input_messages, output_items, output_messages
    msgs = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}])
    assert msgs[0] == {"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "image_url", "image_url": {"url": "u"}}]}
    # the assistant's text and both of its calls: one turn, as the chat's
    assert msgs[1]["role"] == "assistant" and [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "one"},
                        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    # an answer's items continue the conversation
    items = output_items({"reasoning_content": "r", "content": "t", "tool_calls": [
        {"id": "chatcmpl-tool-9", "function": {"name": "f", "arguments": "{}"}}]})
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"] and items[2]["call_id"] == "call_9"
    assert output_messages(items) == [{"role": "assistant", "content": [{"type": "text", "text": "t"}], "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert [i["type"] for i in output_items({"content": ""})] == ["message"]   # an empty answer: one empty message


def test_anthropic_blocks_become_chat_messages():
    from frontend.openai.anthropic import chat_messages, chat_request, MessagesRequest, stop_reason
    msgs = chat_messages([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "let me see"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "42"}]}, {"type": "text", "text": "thanks"}]}], [{"type": "text", "text": "sys"}])
    assert msgs == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "let me see", "tool_calls": [
                        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                    {"role": "tool", "tool_call_id": "t1", "content": "42"},   # the results first,
                    {"role": "user", "content": "thanks"}]                     # then the rest of the turn
    [tool] = chat_messages([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": [
        {"type": "text", "text": "a picture:"},
        {"type": "image", "source": {"type": "url", "url": "http://x/p.png"}}]}]}], None)
    assert tool == {"role": "tool", "tool_call_id": "t2", "content": [
        {"type": "text", "text": "a picture:"}, {"type": "image_url", "image_url": {"url": "http://x/p.png"}}]}
    req = MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": "x"}], tool_choice={"type": "any"},
                          tools=[{"name": "f", "input_schema": {"type": "object"}}], stop_sequences=["END"],
                          thinking={"type": "disabled"})
    body = chat_request(req)
    assert body["tool_choice"] == "required" and body["stop"] == ["END"] and body["max_tokens"] == 5
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["add_generation_prompt"]
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 7, False) == ("end_turn", None)   # a stop token, not a string
    assert stop_reason("length", None, True) == ("max_tokens", None)


def test_response_store_is_a_bounded_lru():
    from frontend.openai.response_store import ResponseStore, StoredResponse
    store = ResponseStore(size=3, max_bytes=10_000)
    put = lambda rid, text="": store.put(StoredResponse({"id": rid, "text": text}, [{"role": "user", "content": ""}]))
    for rid in "abc":
        put(rid)
    assert store.get("a") is not None   # used: the least recently used is now b
    put("d")
    assert store.get("b") is None and [r for r in "acd" if store.get(r)] == ["a", "c", "d"]
    put("e", "x" * 9_950)               # over the bytes: the old ones go, the newest stays
    assert len(store) == 1 and store.get("e") is not None and store.nbytes > 9_950
    put("f", "x" * 20_000)              # bigger than the whole store: kept alone
    assert len(store) == 1 and store.get("f") is not None
    store.pop("f")
    assert store.nbytes == 0 and len(store) == 0
