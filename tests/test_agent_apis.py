"""The APIs coding agents speak, through a real `loom serve` and the official clients: OpenAI's
Responses API (`client.responses`) and Anthropic's Messages API (`anthropic.Anthropic().messages`).

Both are translations into the one chat path, so the oracle is /v1/chat/completions on the same
server: the same greedy request gives the same text and the same prompt tokens. Streamed and
non-streamed answers are the same, and every bad input gets a 4xx in the API's own error shape.

One server for the module: the tiny random model with a Qwen-like chat template (tools, tool
calls and results; the thinking opened by enable_thinking, else closed in the prompt), the hermes
tool parser, the qwen3 reasoning parser and an API key (the anthropic client sends it as
x-api-key). The random model writes garbage unless a grammar holds it (from the first token
when the prompt closed the thinking), so tool calls are asked for by name or as required."""
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

from tests.conftest import running_server

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
