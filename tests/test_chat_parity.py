"""HTTP and offline make the same prompt token ids: one chat parser and one render_chat
(frontend/chat_utils.py), one prompt tokenization (frontend/processing.py's tokenize_prompt).

One `loom serve` and one offline `LLM` on the same tiny model, whose tokenizer adds a BOS token
(so add_special_tokens shows) and whose chat template writes tools, tool calls (arguments with
tojson), tool results and content parts. The server's ids are read from /tokenize and from the
responses' prompt_token_ids (return_token_ids); the offline ones from RequestOutput.prompt_token_ids.
Then fast unit tests of the parser on the cases where the two old parsers differed."""
from __future__ import annotations

import ast
import json
import os
import shutil

import pytest
import requests
from PIL import Image

from frontend.chat_utils import (detect_content_format, image_urls, load_images, message_text, parse_chat_messages,
                                 render_chat)
from frontend.processing import tokenize_prompt, truncate_prompt
from ipc.sampling_params import SamplingParams
from ipc.validation import RequestError
from tests.conftest import ROOT, running_server

# Loops over a message's content, so "auto" gives the template parts ("openai" format).
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}[{{ p['type'] }}]{{ p['text'] }}{% endfor %}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "{% if m['role'] == 'tool' %} (result of {{ m['tool_call_id'] }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Writes content as a string: "auto" joins a message's text parts with newlines for it.
STRING_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "Be brief."}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}
PARTS = {"role": "user", "content": [{"type": "text", "text": "Hello world!"}, "How are you",
                                     {"type": "input_text", "text": "today?"}]}

# (name, messages, keywords of LLM.chat and of the request alike)
CHATS = [
    ("system prompt", [SYSTEM, ASK], {}),
    ("multi-part text, input_text", [SYSTEM, PARTS], {}),
    ("tool calls and results", [SYSTEM, ASK, CALL, RESULT], {"tools": TOOLS}),
    ("no generation prompt", [ASK, {"role": "assistant", "content": "It is"}], {"add_generation_prompt": False}),
    ("continue the final message", [ASK, {"role": "assistant", "content": "It is"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ("chat_template_kwargs", [ASK], {"chat_template_kwargs": {"greeting": "Hello there"}}),
    ("a string template given", [SYSTEM, PARTS], {"chat_template": STRING_TEMPLATE}),
]
PROMPTS = ["Hello world! How are you today?", [5, 6, 7, 8], ""]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with a BOS token its tokenizer adds, and PARTS_TEMPLATE."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    out = str(tmp_path_factory.mktemp("chat-parity"))
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    bos = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    tok.bos_token = bos
    tok.chat_template = PARTS_TEMPLATE
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--max-model-len", "512", "--trust-request-chat-template",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def llm(model_dir):
    from frontend.entrypoints.llm import LLM
    # prompt ids are the frontend's: the engine in this process (no engine core or worker to start)
    engine = LLM(model_dir, multiprocess=False, max_model_len=512, block_size=16)
    yield engine
    engine.shutdown()


def _post(server, path: str, body: dict) -> dict:
    r = requests.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


ONE = SamplingParams(temperature=0, max_tokens=1)


def test_the_tokenizer_adds_a_bos_token(llm):
    """(else add_special_tokens would be compared on a tokenizer where it changes nothing)"""
    tok = llm.get_tokenizer()
    assert tok.encode("Hello") != tok.encode("Hello", add_special_tokens=False)


def test_prompts_one_at_a_time(server, llm):
    for prompt in PROMPTS:
        offline = llm.generate(prompt, ONE, use_tqdm=False)[0].prompt_token_ids
        http = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "return_token_ids": True})
        assert http["choices"][0]["prompt_token_ids"] == offline, prompt
        if isinstance(prompt, str):
            assert _post(server, "/tokenize", {"prompt": prompt})["tokens"] == offline, prompt


def test_a_batch_of_prompts(server, llm):
    batch = ["The quick brown fox", [9, 10, 11], "jumps over the lazy dog.", [12]]
    offline = [o.prompt_token_ids for o in llm.generate(batch, ONE, use_tqdm=False)]
    http = _post(server, "/v1/completions", {"prompt": batch, "max_tokens": 1, "return_token_ids": True})
    assert [c["prompt_token_ids"] for c in sorted(http["choices"], key=lambda c: c["index"])] == offline
    # and as a dict prompt offline (vLLM's TokensPrompt / TextPrompt)
    assert llm.generate({"prompt": batch[0]}, ONE, use_tqdm=False)[0].prompt_token_ids == offline[0]


def test_add_special_tokens_false(server, llm):
    text = PROMPTS[0]
    plain = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"] == plain
    http = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_ids": True,
                                             "add_special_tokens": False})
    assert http["choices"][0]["prompt_token_ids"] == plain
    assert llm.generate({"prompt_token_ids": plain}, ONE, use_tqdm=False)[0].prompt_token_ids == plain


@pytest.mark.parametrize("name, messages, kw", CHATS, ids=[c[0] for c in CHATS])
def test_chats(server, llm, name, messages, kw):
    offline = llm.chat(messages, ONE, use_tqdm=False, **kw)[0].prompt_token_ids
    body = {"messages": messages, **kw}
    assert _post(server, "/tokenize", body)["tokens"] == offline
    http = _post(server, "/v1/chat/completions", {**body, "max_tokens": 1, "return_token_ids": True})
    assert http["prompt_token_ids"] == offline
    # the template saw what the parser made of the messages (not a repr of a list of parts, say)
    text = llm.get_tokenizer().decode(offline)
    assert "{'" not in text and "[{" not in text.replace("Tools: [{", ""), text
    if name == "tool calls and results":
        assert '{"name": "weather", "arguments": {"city": "Paris"}}' in text and "(result of call_1)" in text
        assert '"description": "Weather"' in text
    if name == "multi-part text, input_text":
        assert "[text]Hello world![text]How are you[text]today?" in text
    if name == "a string template given":
        assert "<user>Hello world!\nHow are you\ntoday?</user><assistant>" in text
    if name == "continue the final message":
        assert text.endswith("It is")


def test_a_large_chat_goes_through_the_tokenizer_process(server, llm):
    """Over 64 KiB the API server renders in its tokenizer process: the same ids as LLM.chat's
    path (too long to generate from with this model, so its two functions are called here)."""
    big = {"role": "user", "content": [{"type": "input_text", "text": "Readability counts. " * 4000}, "Why?"]}
    messages = [SYSTEM, ASK, CALL, RESULT, big]
    ids = _post(server, "/tokenize", {"messages": messages, "tools": TOOLS})["tokens"]
    tok = llm.get_tokenizer()
    parsed = parse_chat_messages(messages, detect_content_format(tok.chat_template))
    assert ids == render_chat(tok, parsed, tools=TOOLS)[1]


def test_the_same_mistakes_are_refused_alike(server, llm):
    for messages, kw in [([{"role": "wizard", "content": "x"}], {}),
                         ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], {}),
                         ([{"role": "user", "content": [{"type": "input_audio",
                                                         "input_audio": {"data": "AAAA", "format": "wav"}}]}], {}),
                         ([{"role": "user", "content": None}], {}),
                         ([ASK, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], {}),
                         ([ASK], {"add_generation_prompt": True, "continue_final_message": True})]:
        r = requests.post(server.url + "/tokenize", json={"messages": messages, **kw}, timeout=60)
        assert r.status_code == 400, r.text
        with pytest.raises(ValueError) as offline:
            llm.chat(messages, ONE, use_tqdm=False, **kw)
        assert r.json()["error"]["message"] == str(offline.value)


# ------------------------------------------------------------------ the parser, directly

def test_input_text_and_bare_string_parts_are_text():
    parts = [{"type": "input_text", "text": "a"}, "b", {"type": "text", "text": "c"}]
    [msg] = parse_chat_messages([{"role": "user", "content": parts}], "openai")
    assert msg["content"] == [{"type": "text", "text": t} for t in "abc"]
    [msg] = parse_chat_messages([{"role": "user", "content": parts}], "string")
    assert msg["content"] == "a\nb\nc" and message_text(msg) == "a\nb\nc"


def test_roles_are_openai_roles():
    for role in ("system", "developer", "user", "assistant", "tool", "function"):
        assert parse_chat_messages([{"role": role, "content": "x"}])[0]["role"] == role
    with pytest.raises(RequestError, match="role") as e:
        parse_chat_messages([{"role": "wizard", "content": "x"}])
    assert e.value.param == "messages"


def test_tool_calls_get_their_arguments_as_objects():
    [_, call, result] = parse_chat_messages([ASK, CALL, RESULT])
    assert call["content"] == "" and call["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]
    assert result["tool_call_id"] == "call_1" and result["content"] == "Sunny, 21 C"
    for calls, why in [("x", "list"), ([{"function": {"name": ""}}], "name"),
                       ([{"function": {"name": "f", "arguments": "[1]"}}], "JSON object"),
                       ([{"function": {"name": "f", "arguments": "{"}}], "not valid JSON"),
                       ([{"type": "code", "function": {"name": "f"}}], "'function'")]:
        with pytest.raises(RequestError, match=why):
            parse_chat_messages([ASK, {**CALL, "tool_calls": calls}])
    with pytest.raises(RequestError, match="only assistant"):
        parse_chat_messages([{**ASK, "tool_calls": CALL["tool_calls"]}])
    with pytest.raises(RequestError, match="tool_call_id"):
        parse_chat_messages([{**RESULT, "tool_call_id": 5}])


def test_image_parts_keep_their_source_in_order():
    img = Image.new("RGB", (8, 8), "red")
    msgs = parse_chat_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_pil", "image_pil": img}, {"type": "text", "text": "two pictures"}]}])
    assert [p["type"] for p in msgs[0]["content"]] == ["image", "image", "text"]   # parts, whatever the format
    assert image_urls(msgs) == ["data:image/png;base64,AAAA"]
    assert load_images(parse_chat_messages([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": img}]}]), None)[0].size == (8, 8)
    with pytest.raises(RequestError, match="PIL image"):   # what JSON can send as image_pil
        parse_chat_messages([{"role": "user", "content": [{"type": "image_pil", "image_pil": "x.png"}]}])


def test_render_chat_errors_name_the_parameter(llm):
    tok = llm.get_tokenizer()
    with pytest.raises(RequestError, match="cannot both") as e:
        render_chat(tok, [ASK], add_generation_prompt=True, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    with pytest.raises(RequestError, match="Cannot apply the chat template") as e:
        render_chat(tok, [ASK], chat_template="{{ raise_exception('no') }}")
    assert e.value.param == "messages"


def test_tokenize_prompt_and_truncate():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            return ([0] if add_special_tokens else []) + [ord(c) for c in text]
    assert tokenize_prompt(Tok(), "ab") == ("ab", [0, 97, 98])
    assert tokenize_prompt(Tok(), "ab", add_special_tokens=False) == ("ab", [97, 98])
    assert tokenize_prompt(Tok(), [1, 2]) == (None, [1, 2])
    assert tokenize_prompt(Tok(), {"prompt_token_ids": [3], "prompt": "c"}) == ("c", [3])
    for wrong in (5, [1, "a"], [True], {"prompt_token_ids": "x"}):
        with pytest.raises(RequestError):
            tokenize_prompt(Tok(), wrong)
    assert truncate_prompt([1, 2, 3], 2, 8) == [2, 3] and truncate_prompt([1, 2], -1, 8) == [1, 2]
    assert truncate_prompt([1, 2], None, 8) == [1, 2] and truncate_prompt([1, 2], 0, 8) == []
    for n in (-2, 9):
        with pytest.raises(RequestError) as e:
            truncate_prompt([1], n, 8)
        assert e.value.param == "truncate_prompt_tokens"


def test_one_function_of_each_name():
    """No second chat parser, render_chat or prompt tokenizer grows back beside these."""
    names = {"render_chat", "parse_chat_messages", "normalize_messages", "split_parts", "tokenize_prompt",
             "to_token_ids", "encode_prompts", "detect_content_format"}
    found: dict[str, list[str]] = {}
    for pkg in ("frontend", "multimodal", "engine_core", "ipc", "bench"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    for node in ast.walk(ast.parse(open(path).read())):
                        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
                            found.setdefault(node.name, []).append(os.path.relpath(path, ROOT))
    assert found == {"render_chat": ["frontend/chat_utils.py"], "parse_chat_messages": ["frontend/chat_utils.py"],
                     "detect_content_format": ["frontend/chat_utils.py"],
                     "tokenize_prompt": ["frontend/processing.py"]}, json.dumps(found, indent=1)
