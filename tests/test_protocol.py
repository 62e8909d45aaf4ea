"""Unit tests of the OpenAI wire format (frontend/openai/protocol.py): parsing, validation,
sampling-parameter mapping and response formatting. No engine, no server."""
from __future__ import annotations

import json
import math

import pytest

from frontend.outputs import Logprob
from frontend import chat_utils
from frontend.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                               TokenizeRequest, build_sampling_params, chat_chunk, chat_chunk_choice,
                               chat_logprobs, check_model, completion_logprobs, completion_prompts, error_body,
                               merge_completion_logprobs, models_response, parse_request, sse, stream_usage, usage)
from frontend.openai.serving import value_error
from ipc.validation import Limits, RequestError


def _as_http(fn):
    """fn (frontend/chat_utils.py) as the API server calls it: its RequestError is the 400 it answers."""
    def call(*args, **kw):
        try:
            return fn(*args, **kw)
        except RequestError as e:
            raise value_error(e) from None
    return call


normalize_messages = _as_http(chat_utils.parse_chat_messages)
render_chat = _as_http(chat_utils.render_chat)


def parse(cls, obj):
    return parse_request(json.dumps(obj).encode(), cls)


def _limits(vocab_size: int = 0, max_logprobs: int = 20, priority_scheduling: bool = False) -> Limits:
    return Limits(vocab_size, 4096, max_logprobs, priority_scheduling)


def completion_params(obj, **kw):
    return build_sampling_params(parse(CompletionRequest, {"prompt": "x", **obj}), chat=False, limits=_limits(**kw))


def chat_params(obj, **kw):
    return build_sampling_params(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], **obj}),
                                 chat=True, limits=_limits(**kw))


def bad(fn, *args, status=400, param=None, contains=None, **kw) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(*args, **kw)
    e = ei.value
    assert e.status == status, e.body()
    if param is not None:
        assert e.param == param, e.body()
    if contains is not None:
        assert contains in e.message, e.message
    return e


# ------------------------------------------------------------------ parsing

def test_parse_minimal_completion():
    req = parse(CompletionRequest, {"model": "m", "prompt": "hello"})
    assert req.prompt == "hello" and req.model == "m" and req.max_tokens is None and req.stream is None


def test_parse_ignores_unknown_fields_and_accepts_nulls():
    req = parse(CompletionRequest, {"prompt": "x", "user": "u", "something_new": 1, "temperature": None,
                                    "max_tokens": None, "stop": None})
    p = build_sampling_params(req, chat=False, limits=_limits())
    assert p.temperature == 1.0 and p.max_tokens == 16 and p.stop == []


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"max_tokens": 3}, "prompt"),
])
def test_parse_type_errors_name_the_field(body, param):
    e = bad(parse, CompletionRequest, body, param=param)
    assert e.body()["error"]["type"] == "BadRequestError"
    assert e.body()["error"]["code"] == 400


def test_parse_invalid_json_and_non_object():
    bad(parse_request, b"{not json", CompletionRequest, contains="JSON")
    bad(parse_request, b"", CompletionRequest, contains="empty")
    bad(parse_request, b"[1, 2]", CompletionRequest, contains="object")


def test_parse_chat_requires_messages():
    bad(parse, ChatCompletionRequest, {"model": "m"}, param="messages")


def test_parse_tokenize_detokenize():
    assert parse(TokenizeRequest, {"prompt": "a"}).prompt == "a"
    assert parse(DetokenizeRequest, {"tokens": [1, 2]}).tokens == [1, 2]
    bad(parse, DetokenizeRequest, {}, param="tokens")
    bad(parse, DetokenizeRequest, {"tokens": [1, "a"]}, param="tokens")


def test_check_model():
    check_model(None, "served")
    check_model("served", "served")
    check_model("/path/to/model", "served", also="/path/to/model")
    e = bad(check_model, "other", "served", status=404, param="model")
    assert e.message == "The model `other` does not exist."
    assert e.body()["error"]["type"] == "NotFoundError"


# ------------------------------------------------------------------ prompts and messages

def test_completion_prompt_forms():
    assert completion_prompts("hi") == ["hi"]
    assert completion_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert completion_prompts(["only"]) == ["only"]
    assert completion_prompts([[1], "a"]) == [[1], "a"]
    for wrong in (5, None, {"a": 1}, [1, "a"], [[1], 2], [[1, "a"]], [True, 2], [1.5]):
        bad(completion_prompts, wrong, param="prompt")
    bad(completion_prompts, [], param="prompt", contains="empty")


def test_normalize_messages():
    msgs = normalize_messages([
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert [m["content"] for m in msgs] == ["be nice", "a\nb", ""]
    bad(normalize_messages, [], param="messages")
    bad(normalize_messages, "hi", param="messages")
    bad(normalize_messages, [{"role": "wizard", "content": "x"}], param="messages")
    bad(normalize_messages, [{"content": "x"}], param="messages")
    bad(normalize_messages, [{"role": "user", "content": 5}], param="messages")
    bad(normalize_messages, [{"role": "user"}], param="messages")
    bad(normalize_messages, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        param="messages", contains="image_url")


class _FakeTok:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, continue_final_message, **kw):
        assert tokenize is False
        if messages[0]["role"] == "assistant":
            raise ValueError("Conversation roles must alternate")
        s = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_render_chat():
    text, ids = render_chat(_FakeTok(), [{"role": "user", "content": "hi"}])
    assert text == "<user>hi<assistant>" and len(ids) == len(text)
    bad(render_chat, _FakeTok(), [{"role": "assistant", "content": "x"}], param="messages",
        contains="alternate")
    no_template = _FakeTok()
    no_template.chat_template = None
    bad(render_chat, no_template, [{"role": "user", "content": "x"}], contains="chat template")


# ------------------------------------------------------------------ sampling params

def test_completion_defaults():
    p = completion_params({})
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0 and p.n == 1
    assert p.logprobs is None and p.stop == [] and p.skip_special_tokens


def test_chat_defaults_max_tokens_none():
    p = chat_params({})
    assert p.max_tokens is None and p.temperature == 1.0 and p.logprobs is None


def test_all_fields_mapped():
    p = completion_params({"max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 3,
                           "n": 2, "stop": "END", "stop_token_ids": [4], "ignore_eos": True,
                           "include_stop_str_in_output": True, "min_tokens": 2, "presence_penalty": 0.5,
                           "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"5": 10},
                           "logprobs": 3, "skip_special_tokens": False})
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.n) == (7, 0.0, 0.5, 5, 0.1, 3, 2)
    assert p.stop == ["END"] and p.stop_token_ids == [4] and p.ignore_eos and p.include_stop_str_in_output
    assert (p.min_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (2, 0.5, -0.5, 1.2)
    assert p.logit_bias == {5: 10.0} and p.logprobs == 3 and not p.skip_special_tokens
    assert completion_params({"top_k": -1}).top_k == 0
    assert completion_params({"stop": ["a", "b"]}).stop == ["a", "b"]


def test_chat_max_completion_tokens_and_logprobs():
    assert chat_params({"max_tokens": 5}).max_tokens == 5
    assert chat_params({"max_completion_tokens": 6, "max_tokens": 5}).max_tokens == 6
    assert chat_params({"logprobs": True}).logprobs == 0
    assert chat_params({"logprobs": True, "top_logprobs": 4}).logprobs == 4
    assert chat_params({"logprobs": False}).logprobs is None
    bad(chat_params, {"top_logprobs": 2}, param="top_logprobs")
    bad(chat_params, {"logprobs": True, "top_logprobs": 50}, param="top_logprobs", max_logprobs=20)
    bad(chat_params, {"max_completion_tokens": 0}, param="max_completion_tokens")


def test_response_format_becomes_a_constraint():
    from frontend.openai.constraints import request_constraint
    req = lambda body: parse_request(json.dumps({"messages": [], **body}).encode(), ChatCompletionRequest)
    assert request_constraint(req({"response_format": {"type": "text"}})) is None
    assert request_constraint(req({"response_format": {"type": "json_object"}})).json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = request_constraint(req({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}))
    assert c.json == schema
    bad(request_constraint, req({"response_format": {"type": "xml"}}), param="response_format")
    bad(request_constraint, req({"response_format": {"json_schema": {"schema": schema}}}), param="response_format")


def test_priority_needs_the_priority_policy():
    # vLLM's answer under its default first-come-first-served policy
    bad(completion_params, {"priority": 3}, param="priority", contains="Priority scheduling is not enabled")
    completion_params({"priority": 0})
    completion_params({"priority": -3}, priority_scheduling=True)
    bad(chat_params, {"priority": 2 ** 63}, param="priority", priority_scheduling=True)


def test_bad_words_are_bounded_before_they_are_tokenized():
    assert chat_params({"bad_words": ["cat", " dog"]}).bad_words == ["cat", " dog"]
    assert completion_params({"bad_words": []}).bad_words is None
    bad(chat_params, {"bad_words": ["  "]}, param="bad_words")
    bad(chat_params, {"bad_words": ["x" * 257]}, param="bad_words")
    bad(completion_params, {"bad_words": ["w"] * 129}, param="bad_words")


def test_allowed_token_ids():
    assert completion_params({"allowed_token_ids": [1, 2]}, vocab_size=10).allowed_token_ids == [1, 2]
    assert chat_params({"allowed_token_ids": [3]}, vocab_size=10).allowed_token_ids == [3]
    bad(completion_params, {"allowed_token_ids": []}, param="allowed_token_ids")
    bad(completion_params, {"allowed_token_ids": [10]}, vocab_size=10, param="allowed_token_ids")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
])
def test_invalid_sampling_fields(fields, param):
    e = bad(completion_params, fields, param=param, max_logprobs=20, vocab_size=1000)
    assert e.message.startswith(param) or param in e.message


def test_stream_usage():
    req = parse(CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert stream_usage(req) == (True, False)
    assert stream_usage(parse(CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})) == (True, True)
    # continuous_usage_stats alone is nothing (vLLM: it needs include_usage)
    assert stream_usage(parse(CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {
        "continuous_usage_stats": True}})) == (False, False)
    assert stream_usage(parse(CompletionRequest, {"prompt": "x", "stream": True})) == (False, False)


# ------------------------------------------------------------------ responses

def _lp_entries():
    # token 7 sampled (rank 2), top-2 are 9 (rank 1) and 7 (rank 2); token 3 sampled (rank 5)
    return [
        {7: Logprob(-1.0, 2, "b"), 9: Logprob(-0.5, 1, "a")},
        {3: Logprob(-3.0, 5, "c"), 9: Logprob(-0.1, 1, "a"), 4: Logprob(-float("inf"), 2, "d")},
    ]


def test_completion_logprobs_format():
    lp, off = completion_logprobs([7, 3], _lp_entries(), num_top=2, text_offset=10)
    assert lp["tokens"] == ["b", "c"]
    assert lp["token_logprobs"] == [-1.0, -3.0]
    assert lp["top_logprobs"][0] == {"b": -1.0, "a": -0.5}
    assert lp["top_logprobs"][1] == {"c": -3.0, "a": -0.1, "d": -9999.0}  # -inf clamped, JSON-safe
    assert lp["text_offset"] == [10, 11] and off == 12
    json.dumps(lp, allow_nan=False)


def test_completion_logprobs_zero_gives_sampled_only():
    lp, _ = completion_logprobs([7, 3], _lp_entries(), num_top=0)
    assert lp["top_logprobs"] == [{"b": -1.0}, {"c": -3.0}]
    merged = merge_completion_logprobs([lp, lp])
    assert len(merged["tokens"]) == 4 and set(merged) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


def test_chat_logprobs_format():
    out = chat_logprobs([7, 3], _lp_entries(), num_top=2)
    first, second = out["content"]
    assert first == {"token": "b", "logprob": -1.0, "bytes": [98],
                     "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                      {"token": "b", "logprob": -1.0, "bytes": [98]}]}
    assert [t["token"] for t in second["top_logprobs"]] == ["a", "d"]   # top 2 by rank; sampled rank 5 is not
    assert second["top_logprobs"][1]["logprob"] == -9999.0
    assert chat_logprobs([7], _lp_entries()[:1], num_top=0)["content"][0]["top_logprobs"] == []
    json.dumps(out, allow_nan=False)


def test_error_body_shape():
    assert error_body("boom", 400, "x") == {"error": {"message": "boom", "type": "BadRequestError",
                                                      "param": "x", "code": 400}}
    assert APIError("no", 503).body()["error"]["type"] == "ServiceUnavailableError"
    assert APIError("no", 401).body()["error"]["code"] == 401


def test_usage_and_models_and_sse():
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    m = models_response("name", "/root", 128)
    assert m["object"] == "list" and m["data"][0]["id"] == "name" and m["data"][0]["object"] == "model"
    chunk = chat_chunk("chatcmpl-1", 5, "name", [chat_chunk_choice(0, {"role": "assistant", "content": ""})])
    raw = sse(chunk)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[6:]) == chunk
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["finish_reason"] is None
    assert not math.isnan(usage(0, 0)["total_tokens"])


def test_detect_content_format():
    from frontend.chat_utils import detect_content_format
    assert detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    assert detect_content_format("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}"
                                 "{% endfor %}{% endfor %}") == "openai"
    assert detect_content_format("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}"
                                 "{% endfor %}{% endfor %}") == "openai"
    assert detect_content_format("{% for m in messages") == "string" and detect_content_format(None) == "string"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]
    assert normalize_messages(parts, "openai")[0]["content"] == [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]
    assert normalize_messages(parts, "string")[0]["content"] == "a\nb"


def test_echoed_prompt_logprobs_format():
    from frontend.openai.protocol import prompt_logprobs_json
    entries = [None, {7: Logprob(-1.0, 2, "b"), 9: Logprob(-float("inf"), 1, "a")}]
    lp, off = completion_logprobs([5, 7], entries, num_top=1, decode=lambda t: "xy")
    assert lp["tokens"] == ["xy", "b"] and lp["token_logprobs"] == [None, -1.0]
    assert lp["top_logprobs"] == [None, {"b": -1.0, "a": -9999.0}] and lp["text_offset"] == [0, 2] and off == 3
    lp, _ = completion_logprobs([5, 7], entries, num_top=0, as_ids=True)
    assert lp["tokens"] == ["token_id:5", "token_id:7"]
    assert prompt_logprobs_json(entries) == [None, {"7": {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
                                                    "9": {"logprob": -9999.0, "rank": 1, "decoded_token": "a"}}]


def test_a_utility_call_whose_arguments_do_not_encode_leaves_no_reply_waiting(tmp_path):
    """An int past 64 bits in a control call's arguments is the caller's error (a 400 over HTTP), and
    nothing of the call stays: its reply future stayed registered, and the engine's death later
    failed it unretrieved ("Future exception was never retrieved"), one per such call."""
    import asyncio

    from frontend.engine_client import AsyncEngineCoreClient

    async def main():
        client = AsyncEngineCoreClient(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", 0, lambda o: None,
                                       lambda r: None)
        client.engines = {0: b"no-such-engine"}   # (a ROUTER drops what it cannot route)
        try:
            with pytest.raises(OverflowError):
                await client.call_utility("ping", 2 ** 70, timeout=5)
            assert client._calls == {}
        finally:
            client.close()
    asyncio.run(main())


def test_invalid_utf8_is_located_in_the_body():
    """The 400 names the bad byte's offset in the body (it gave its offset inside the JSON string)."""
    from frontend.openai.protocol import parse_request
    body = b'{"prompt": "\xff\xfe abc"}'
    with pytest.raises(APIError, match="at byte 12"):
        parse_request(body, CompletionRequest)
