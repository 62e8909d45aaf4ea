"""Structured outputs and tool calling through a real `loom serve` and the official openai client.

The tiny random model emits garbage unless the grammar holds it, so every answer that parses
and validates is the engine's doing. One server for the module (with a tool-aware chat template
and the hermes tool parser)."""
from __future__ import annotations

import json
import os
import re
import shutil

import jsonschema
import openai
import pydantic
import pytest
import requests

from tests.conftest import openai_client, running_server

# Qwen-like: tools in a system block, assistant tool calls as <tool_call> blocks, tool results
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "enum": ["Paris", "Rome"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                                          "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "boolean"}}, "required": ["a", "b"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": -5, "maximum": 200},
                                           "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"]}
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
SEEDS = range(2)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)   # bounded, or a random model may write until max_tokens
    age: int = pydantic.Field(ge=0, le=150)
    likes_cats: bool


@pytest.fixture(scope="module")
def model_dir(model_factory, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tools-model"))
    src = model_factory("qwen3")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TOOL_TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f)
    for name in ("chat_template.jinja", "chat_template.json"):   # where transformers 5 may keep it
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server, 120)


@pytest.fixture(scope="module")
def model(server) -> str:
    return requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


# ------------------------------------------------------------------ constraints

def test_parse_with_pydantic_model(client, model):
    # the issue's client.beta.chat.completions.parse, and its current name client.chat.completions.parse
    for seed, parse in zip(SEEDS, (client.beta.chat.completions.parse, client.chat.completions.parse)):
        r = parse(model=model, messages=MESSAGES, response_format=Person, temperature=1.0, seed=seed, max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person)
        jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_schema_response_format_validates(client, model, endpoint):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in SEEDS:
        if endpoint == "chat":
            r = client.chat.completions.create(model=model, messages=MESSAGES, response_format=rf, temperature=1.0,
                                               seed=seed, max_tokens=300)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        else:
            r = client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=seed,
                                          max_tokens=300, extra_body={"response_format": rf})
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_structured_outputs_json(client, model):
    for seed in SEEDS:
        r = client.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "json_object"},
                                           temperature=1.0, seed=seed, max_tokens=300)
        if r.choices[0].finish_reason == "stop":   # any object may run past max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        r = client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=seed, max_tokens=300,
                                      extra_body={"structured_outputs": {"json": SCHEMA}})
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
        r = client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=seed, max_tokens=300,
                                      extra_body={"guided_json": SCHEMA})
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_choice_regex_grammar(client, model):
    choices = ["yes", "no", "maybe not"]
    pattern = r"[a-c]{2,4}-\d{3}(x|yz)?"
    for seed in SEEDS:
        for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
            r = client.completions.create(model=model, prompt="Is it?", temperature=1.0, seed=seed, max_tokens=30,
                                          extra_body=body)
            assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
        for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
            r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, seed=seed,
                                               max_tokens=30, extra_body=body)
            assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content
        r = client.completions.create(model=model, prompt="Say", temperature=1.0, seed=seed, max_tokens=30,
                                      extra_body={"structured_outputs": {"grammar": 'root ::= "ab" d d? "!"\nd ::= [0-9]'}})
        assert re.fullmatch(r"ab[0-9]{1,2}!", r.choices[0].text), r.choices[0].text


def test_a_constraint_its_own_allowed_tokens_dead_end_is_400(server, model):
    """The grammar needs "!" after at most two digits, which allowed_token_ids leave out: the
    request fails after a few tokens, for its own parameters: a 400 (it was a 500), streamed too."""
    ids = [requests.post(server.url + "/tokenize", json={"model": model, "prompt": c, "add_special_tokens": False},
                         timeout=30).json()["tokens"] for c in "ab0123456789"]
    body = {"model": model, "prompt": "Say", "max_tokens": 30, "temperature": 1.0, "seed": 0,
            "structured_outputs": {"grammar": 'root ::= "ab" d d? "!"\nd ::= [0-9]'},
            "allowed_token_ids": [t for one in ids for t in one]}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and "no token is left to sample" in r.json()["error"]["message"], r.text
    r = requests.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=120)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400 and "no token is left" in events[-1]["error"]["message"], events
    assert len(events) > 2   # it failed after some tokens (before any, it was a 400 already)
    assert _post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_tokenize_renders_the_tools(server, model_dir):
    """/tokenize passes tools to the chat template, as a chat request does (they were dropped)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    r = _post(server, "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "get_weather" in text and r.json()["tokens"] == tok.encode(text, add_special_tokens=False)


def test_streamed_constrained_output_equals_whole(client, model):
    body = {"structured_outputs": {"json": SCHEMA}}
    whole = client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=7, max_tokens=300,
                                      extra_body=body).choices[0].text
    parts = client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=7, max_tokens=300,
                                      extra_body=body, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole


def test_mixed_batch_free_requests_untouched(client, model):
    """Constrained and free requests at once: the free ones equal their solo greedy output."""
    from concurrent.futures import ThreadPoolExecutor
    prompts = ["Beautiful is better than", "The quick brown fox", "Hello world!"]
    solo = [client.completions.create(model=model, prompt=p, temperature=0, max_tokens=24).choices[0].text
            for p in prompts]

    def free(p):
        return client.completions.create(model=model, prompt=p, temperature=0, max_tokens=24).choices[0].text

    def constrained(seed):
        return client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=seed, max_tokens=300,
                                         extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        cons = [pool.submit(constrained, s) for s in range(4)]
        frees = [pool.submit(free, p) for p in prompts]
        assert [f.result() for f in frees] == solo
        for c in cons:
            jsonschema.validate(json.loads(c.result()), SCHEMA)


# ------------------------------------------------------------------ invalid input

def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    # wrong types: these once reached the engine, which could not decode them and never answered
    ("/v1/completions", {"structured_outputs": {"choice": "abc"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": "yes"}},
     "structured_outputs"),
    # 400 nested properties took 29 s to compile, holding up every other request's tokenization
    ("/v1/completions", {"structured_outputs": {"json": _nested_schema(400)}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": json.dumps(_nested_schema(400))}, "guided_json"),
    # past MAX_CONSTRAINT_CHARS (a 2.4 MB choice took 68 s to compile, one grammar at a time)
    ("/v1/completions", {"structured_outputs": {"choice": [f"{i:04d}" * 200 for i in range(200)]}},
     "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a" * (130 * 1024)}, "guided_regex"),
    # keywords xgrammar accepts and ignores: its output broke them and finished with "stop"
    ("/v1/completions", {"guided_json": {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}},
     "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json": {"allOf": [{"type": "object"}, {"required": ["b"]}]}}},
     "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}}}},
     "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["zz"]}}}], "tool_choice": "required"}, "tools"),
    # schemas that admit no value: the output was empty, or a number for a string, and said "stop"
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"anyOf": []}}}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object", "properties": {
        "a": {"type": "string", "enum": [1]}}}}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_invalid_constraints_are_400_and_server_keeps_serving(server, model, path, body, param):
    base = {"model": model, "max_tokens": 8}
    base.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})
    r = _post(server, path, {**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == param and err["message"]
    ok = _post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_malformed_tool_calls_in_messages_are_400(server, model):
    bad = [
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "add", "arguments": "{oops"}}]}],
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {}}]}],
        [{"role": "assistant", "content": None, "tool_calls": {"id": "c1"}}],
        [{"role": "user", "content": "x", "tool_calls": []}],
        # arguments nested past the recursion limit (a 500 once)
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "add", "arguments": "[" * 100_000 + "]" * 100_000}}]}],
    ]
    for messages in bad:
        r = _post(server, "/v1/chat/completions", {"model": model, "messages": MESSAGES + messages, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "tool_calls" in r.json()["error"]["message"]


# ------------------------------------------------------------------ tools

def _check_calls(calls, names=None):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def _stream_calls(stream):
    """OpenAI's tool_calls deltas, accumulated as the openai client's users do."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            c["id"] = d.id or c["id"]
            if d.function is not None:
                c["name"] = d.function.name or c["name"]
                c["arguments"] += d.function.arguments or ""
    return calls, finish, content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client, model, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in SEEDS:
        for choice, names in (("required", None), (named, {"get_weather"})):
            kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                      max_tokens=300)
            if not stream:
                r = client.chat.completions.create(**kw)
                assert r.choices[0].finish_reason == "tool_calls"
                _check_calls(r.choices[0].message.tool_calls, names)
                continue
            calls, finish, content = _stream_calls(client.chat.completions.create(stream=True, **kw))
            assert finish == "tool_calls" and not content and calls
            for c in calls.values():
                assert c["id"].startswith("chatcmpl-tool-") and (names is None or c["name"] in names)
                jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


def test_tool_choice_required_with_pydantic_defs(client, model):
    # pydantic puts nested models in "$defs" and refers to them as "#/$defs/X": lifted to the root
    # of the grammar's schema (as vLLM), where those references point (a 400 "Cannot find field" once)
    greet = {"type": "function", "function": {"name": "greet", "parameters": {
        "$defs": {"Who": {"type": "object", "properties": {"name": {"type": "string", "enum": ["Ann", "Bob"]}},
                          "required": ["name"]}},
        "type": "object", "properties": {"who": {"$ref": "#/$defs/Who"}}, "required": ["who"]}}}
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=[TOOLS[1], greet], tool_choice="required",
                                       temperature=1.0, seed=0, max_tokens=300)
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        params = greet["function"]["parameters"] if call.function.name == "greet" else PARAMS[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), params)
    other = json.loads(json.dumps(greet))
    other["function"]["name"] = "greet2"
    other["function"]["parameters"]["$defs"]["Who"]["properties"]["name"]["enum"] = ["Cy"]
    with pytest.raises(openai.BadRequestError, match="differently"):
        client.chat.completions.create(model=model, messages=MESSAGES, tools=[greet, other], tool_choice="required",
                                       max_tokens=8)


def test_tool_choice_none_gives_no_calls(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_hermes_parser_turns_tool_call_text_into_calls(client, model, server, stream):
    """The model's output is made to be hermes tool-call text (by a grammar: this model knows no
    syntax of its own); the server's hermes parser turns it into tool_calls."""
    before = _invocations(server)
    grammar = ('root ::= "Let me check. <tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": '
               '{\\"city\\": \\"" ("Paris" | "Rome") "\\", \\"days\\": " [1-9] "}}</tool_call>"')
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=3,
              max_tokens=200, extra_body={"structured_outputs": {"grammar": grammar}})
    if stream:
        calls, finish, content = _stream_calls(client.chat.completions.create(stream=True, **kw))
        assert finish == "tool_calls" and content == "Let me check. "
        [c] = calls.values()
        assert c["name"] == "get_weather" and c["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(c["arguments"]), PARAMS["get_weather"])
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content == "Let me check. "
        _check_calls(r.choices[0].message.tool_calls, {"get_weather"})
    assert _invocations(server, "streaming" if stream else "non_streaming", "tool_call") > \
        before.get(("streaming" if stream else "non_streaming", "tool_call"), 0)


def _invocations(server, mode=None, outcome=None):
    text = requests.get(server.url + "/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        if line.startswith("vllm:tool_call_parser_invocations_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            found[(labels["mode"], labels["outcome"])] = found.get((labels["mode"], labels["outcome"]), 0) + \
                float(line.rsplit(" ", 1)[1])
    return found if mode is None else found.get((mode, outcome), 0)


def test_tool_calls_and_tool_results_go_back_through_the_template(server, model):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = _post(server, "/tokenize", {"model": model, "messages": messages, "return_token_strs": False})
    assert r.status_code == 200, r.text
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(model).decode(r.json()["tokens"])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny" in text
    r = _post(server, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
