"""vLLM's API surface that real clients use (issue 10, part 4), against ONE real `loom serve` of a
tiny float32 model, with the official `openai` client where it can express the request:
lm-evaluation-harness scoring (echo + logprobs, max_tokens 0 and 1) equal to HF log-softmax,
prompt_logprobs, return_token_ids, return_tokens_as_token_ids, continuous usage stats,
stop_token_ids text, /tokenize token_strs, /tokenizer_info, /invocations, prompt_tokens_details,
truncate_prompt_tokens, chat echo, content parts handed to the chat template, the vllm:* metrics."""
from __future__ import annotations

import json
import math
import time

import openai
import pytest
import requests

from tests.conftest import openai_client, running_server
from tests.hf_oracle import hf_greedy, hf_logprobs

MAX_MODEL_LEN = 256
TEMPLATE_BUDGET_S = 2
PROMPT_IDS = [11, 12, 13, 14, 15, 16, 17, 18]
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}[{{ p['text'] }}]"
                  "{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # a 2 s template budget (5 by default): the looping template's test waits it out
    with running_server(tiny_model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details",
                        "--enable-tokenizer-info-endpoint", "--trust-request-chat-template",
                        env={"LOOM_CHAT_TEMPLATE_TIMEOUT_S": str(TEMPLATE_BUDGET_S)}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=60, **kw)


def _sse(resp) -> list[dict]:
    events = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


# ------------------------------------------------------------------ lm-evaluation-harness scoring

@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_like_lm_eval(client, model, tiny_model_dir, tok, max_tokens):
    """echo + logprobs: the prompt's logprobs equal HF log-softmax; the first prompt token's is null."""
    text = "Beautiful is better than ugly."
    ids = tok.encode(text)
    ref = hf_logprobs(tiny_model_dir, ids)
    for prompt in (text, ids):
        r = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
                                      temperature=0)
        lp = r.choices[0].logprobs
        n = len(ids)
        assert len(lp.token_logprobs) == n + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(1, n):
            assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4), p
            top = lp.top_logprobs[p]
            best = int(ref[p - 1].argmax())
            assert max(top.values()) == pytest.approx(float(ref[p - 1, best]), abs=1e-4)
            assert 1 <= len(top) <= 2
        # is_greedy as lm-eval computes it: the top token is the prompt token
        assert r.choices[0].text.startswith(text if isinstance(prompt, str) else tok.decode(ids))
        if max_tokens == 0:
            assert r.choices[0].text == (text if isinstance(prompt, str) else tok.decode(ids))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert r.usage.prompt_tokens == n


def test_max_tokens_zero_without_echo_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    assert ei.value.param == "max_tokens"


def test_echo_logprobs_stream(server, tok):
    r = _post(server, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "logprobs": 0, "max_tokens": 3,
                                          "temperature": 0, "ignore_eos": True, "stream": True}, stream=True)
    events = _sse(r)
    tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert len(tokens) == len(PROMPT_IDS) + 3 and tokens[0] is None and all(t is not None for t in tokens[1:])


# ------------------------------------------------------------------ prompt_logprobs

def test_prompt_logprobs_completions_and_chat(server, tiny_model_dir):
    ref = hf_logprobs(tiny_model_dir, PROMPT_IDS)
    r = _post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": 2, "n": 2,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(PROMPT_IDS) and plp[0] is None
        for p in range(1, len(PROMPT_IDS)):
            entry = plp[p][str(PROMPT_IDS[p])]
            assert entry["logprob"] == pytest.approx(float(ref[p - 1, PROMPT_IDS[p]]), abs=1e-4)
            assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
            assert 1 <= len(plp[p]) <= 3
    assert r.json()["choices"][0]["token_ids"] is None and r.json()["choices"][0]["prompt_token_ids"] is None
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                               "prompt_logprobs": 0})
    body = r.json()
    assert r.status_code == 200 and body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 3
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])
    r = _post(server, "/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    # without prompt_logprobs the key is there, null (vLLM's shape)
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).json()["choices"][0][
        "prompt_logprobs"] is None


# ------------------------------------------------------------------ token ids

def test_return_token_ids(server, client, model, tiny_model_dir):
    expected = hf_greedy(tiny_model_dir, PROMPT_IDS, 5)
    body = {"prompt": PROMPT_IDS, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    c = _post(server, "/v1/completions", body).json()["choices"][0]
    assert c["prompt_token_ids"] == PROMPT_IDS and c["token_ids"] == expected
    events = _sse(_post(server, "/v1/completions", {**body, "stream": True}, stream=True))
    choices = [ch for e in events for ch in e["choices"]]
    assert choices[0]["prompt_token_ids"] == PROMPT_IDS
    assert all(ch.get("prompt_token_ids") is None for ch in choices[1:])
    assert [t for ch in choices for t in ch["token_ids"]] == expected
    # chat: prompt_token_ids on the response (and the first chunk), token_ids on each choice
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = _post(server, "/v1/chat/completions", chat).json()
    tokenized = _post(server, "/tokenize", {"messages": chat["messages"]}).json()["tokens"]
    assert r["prompt_token_ids"] == tokenized and len(r["choices"][0]["token_ids"]) == 4
    events = _sse(_post(server, "/v1/chat/completions", {**chat, "stream": True}, stream=True))
    assert events[0]["prompt_token_ids"] == tokenized
    assert [t for e in events for ch in e["choices"] for t in ch.get("token_ids") or []] == r["choices"][0]["token_ids"]


def test_bad_words(client, model, tok, tiny_model_dir):
    # vLLM's bad_words through the openai client: the server bans each word's token sequences
    # (as written and with a leading space); HF greedy with those sequences banned is the oracle.
    # The word is two tokens of the unbanned output, so the ban changes it.
    from frontend.processing import tokenize_bad_words
    from ipc.sampling_params import SamplingParams
    base = hf_greedy(tiny_model_dir, PROMPT_IDS, 12)
    seqs = lambda w: tokenize_bad_words(tok, SamplingParams(bad_words=[w])).bad_words_token_ids
    k, word = next((i, w) for i in range(1, 10) if (w := tok.decode(base[i:i + 2])).strip()
                   and base[i:i + 2] in seqs(w) and base[i] != PROMPT_IDS[-1])
    r = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, "bad_words": [word]})
    out = r.choices[0].model_extra["token_ids"]
    assert out == hf_greedy(tiny_model_dir, PROMPT_IDS, 12, bad_words_ids=seqs(word))
    assert out[:k + 1] == base[:k + 1] and out != base
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=2, extra_body={"bad_words": [" "]})


def test_return_tokens_as_token_ids(server):
    r = _post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 3, "logprobs": 2, "temperature": 0,
                                          "ignore_eos": True, "return_tokens_as_token_ids": True,
                                          "return_token_ids": True}).json()["choices"][0]
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
    assert all(k.startswith("token_id:") for top in r["logprobs"]["top_logprobs"] for k in top)
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                               "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True,
                                               "return_token_ids": True}).json()["choices"][0]
    assert [c["token"] for c in r["logprobs"]["content"]] == [f"token_id:{t}" for t in r["token_ids"]]


# ------------------------------------------------------------------ usage

def test_continuous_usage_stats(server):
    for path, body in [("/v1/completions", {"prompt": PROMPT_IDS}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        events = _sse(_post(server, path, {**body, "max_tokens": 4, "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}}, stream=True))
        with_choices = [e for e in events if e["choices"]]
        assert with_choices and all("usage" in e for e in with_choices)
        counts = [e["usage"]["completion_tokens"] for e in with_choices]
        assert counts == sorted(counts) and counts[-1] == 4
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": events[-1]["usage"][
            "prompt_tokens_details"]["cached_tokens"]}
        # include_usage alone: usage only at the end
        events = _sse(_post(server, path, {**body, "max_tokens": 2, "stream": True,
                                           "stream_options": {"include_usage": True}}, stream=True))
        assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]


def test_prompt_tokens_details_always_there(server):
    prompt = list(range(20, 60))
    first = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    again = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert "prompt_tokens_details" in first and first["prompt_tokens_details"]["cached_tokens"] >= 0
    assert again["prompt_tokens_details"]["cached_tokens"] >= 32   # two full blocks of 16 were cached


# ------------------------------------------------------------------ stop tokens, truncation

def test_stop_token_ids_text(server, tiny_model_dir, tok):
    out = hf_greedy(tiny_model_dir, PROMPT_IDS, 12)
    j = next(j for j in range(1, len(out)) if out[j] not in out[:j])   # the first new token stops it
    stop = out[j]
    body = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop],
            "return_token_ids": True}
    c = _post(server, "/v1/completions", body).json()["choices"][0]
    assert c["token_ids"] == out[:j + 1] and c["stop_reason"] == stop and c["finish_reason"] == "stop"
    assert c["text"] == tok.decode(out[:j])       # the stop token's text is dropped (vLLM)
    c = _post(server, "/v1/completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert c["text"] == tok.decode(out[:j + 1])


def test_truncate_prompt_tokens(server, tiny_model_dir):
    long = list(range(20, 120))
    body = {"prompt": long, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 10}).json()
    assert r["usage"]["prompt_tokens"] == 10 and r["choices"][0]["prompt_token_ids"] == long[-10:]
    assert r["choices"][0]["token_ids"] == hf_greedy(tiny_model_dir, long[-10:], 3)
    for n in (len(long) + 1, 2 * len(long) - 1, -1):   # more than the prompt: all of it (tokens were dropped)
        r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": n}).json()
        assert r["choices"][0]["prompt_token_ids"] == long, n
    r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


# ------------------------------------------------------------------ chat echo and content parts

def test_chat_echo_with_continue_final_message(client, model):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Beautiful is"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"echo": True, "continue_final_message": True,
                                                   "add_generation_prompt": False})
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content == "Beautiful is" + plain.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0, stream=True,
                                            extra_body={"echo": True, "continue_final_message": True,
                                                        "add_generation_prompt": False})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    # with a generation prompt the last message is the user's: nothing to echo (its role is not the answer's)
    r = client.chat.completions.create(model=model, messages=msgs[:1], max_tokens=2, extra_body={"echo": True})
    assert not r.choices[0].message.content.startswith("hi") or r.choices[0].message.content == ""


def test_content_parts_reach_the_template(server, tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    # a template that iterates over the parts gets them as parts ("openai" format, detected)
    r = _post(server, "/tokenize", {"messages": parts, "chat_template": PARTS_TEMPLATE, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode("<user>[a][b]", add_special_tokens=False)
    # the model's own template uses content as a string: parts are joined with a newline
    joined = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "a\nb"}]}).json()["tokens"]
    assert _post(server, "/tokenize", {"messages": parts}).json()["tokens"] == joined


# ------------------------------------------------------------------ small endpoints

def test_tokenize_token_strs_and_tokenizer_info(server, tok):
    r = _post(server, "/tokenize", {"prompt": "hello"}).json()
    assert r["token_strs"] is None and r["tokens"] == tok.encode("hello")
    r = _post(server, "/tokenize", {"prompt": "hello", "return_token_strs": True}).json()
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    info = requests.get(server.url + "/tokenizer_info", timeout=10).json()
    assert info["tokenizer_class"] == type(tok).__name__ and info["eos_token"] == "<|im_end|>"
    assert "chat_template" in info


def test_invocations(server):
    c = _post(server, "/invocations", {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0}).json()
    assert c["object"] == "text_completion"
    direct = _post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0}).json()
    assert c["choices"][0]["text"] == direct["choices"][0]["text"]
    c = _post(server, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert c["object"] == "chat.completion"
    r = _post(server, "/invocations", {"input": "hi"})
    assert r.status_code == 400
    assert _post(server, "/invocations", [1, 2]).status_code == 400


def test_unknown_role_and_oov_detokenize_stay_strict(server):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server, "/detokenize", {"tokens": [10 ** 6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_vllm_request_metrics(server):
    _post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 3, "n": 2, "ignore_eos": True})
    text = requests.get(server.url + "/metrics", timeout=10).text
    for family in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
                   "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens",
                   "vllm:request_inference_time_seconds", "vllm:request_prefill_kv_computed_tokens",
                   "vllm:num_requests_waiting_by_reason", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached"):
        assert f"# TYPE {family}" in text, family
    line = next(x for x in text.splitlines() if x.startswith("vllm:request_max_num_generation_tokens_sum"))
    assert float(line.rsplit(" ", 1)[1]) >= 3
    assert not math.isnan(float(line.rsplit(" ", 1)[1]))


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized_in_full(server):
    """Issue 54: an 8 MiB prompt is refused within 1 s (its probe prefix already passes
    --max-model-len), while another user's 100 kB input in the same large-input lane answers in
    its normal time."""
    import threading

    mid = "lorem ipsum dolor sit amet " * 4000   # ~108 kB: the large-input lane (tokenizer process)
    t0 = time.monotonic()
    assert _post(server, "/tokenize", {"prompt": mid}).status_code == 200   # (starts the process)
    t0 = time.monotonic()
    assert _post(server, "/tokenize", {"prompt": mid}).status_code == 200
    normal = time.monotonic() - t0
    huge = "lorem ipsum dolor sit amet " * (8 * 1024 * 1024 // 27 - 64)
    result = {}

    def other_user():
        time.sleep(0.1)
        t = time.monotonic()
        result["status"] = _post(server, "/tokenize", {"prompt": mid}).status_code
        result["took"] = time.monotonic() - t

    th = threading.Thread(target=other_user)
    th.start()
    t0 = time.monotonic()
    r = _post(server, "/v1/completions", {"prompt": huge, "max_tokens": 1})
    refused_in = time.monotonic() - t0
    th.join(60)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    print(f"8 MiB prompt refused in {refused_in:.2f}s; a 108 kB /tokenize took {result['took']:.2f}s "
          f"(alone {normal:.2f}s)")
    assert refused_in < 1.0
    assert result["status"] == 200 and result["took"] < normal + 1.0


def test_a_request_template_that_loops_is_cut_at_its_budget(server):
    """Issue 54: a trusted request template with nested loops renders in the tokenizer process
    and is stopped at LOOM_CHAT_TEMPLATE_TIMEOUT_S (a 400); a small /tokenize meanwhile answers
    within 0.5 s, and the next template request works."""
    import threading

    loops = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x"
             "{% endfor %}{% endfor %}{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}]
    result = {}

    def looping():
        t = time.monotonic()
        result["r"] = _post(server, "/tokenize", {"messages": msgs, "chat_template": loops})
        result["took"] = time.monotonic() - t

    th = threading.Thread(target=looping)
    th.start()
    time.sleep(0.5)
    worst = 0.0
    for _ in range(5):
        t0 = time.monotonic()
        assert _post(server, "/tokenize", {"prompt": "hello there"}).status_code == 200
        worst = max(worst, time.monotonic() - t0)
    th.join(60)
    r = result["r"]
    assert r.status_code == 400 and "did not render within" in r.json()["error"]["message"], r.text
    assert TEMPLATE_BUDGET_S <= result["took"] < TEMPLATE_BUDGET_S + 15.0   # the budget (+ the tokenizer process's start, if first)
    assert worst < 0.5, f"a small /tokenize took {worst:.2f}s beside a looping template"
    ok = _post(server, "/tokenize", {"messages": msgs, "chat_template": "{{ messages[0]['content'] }}"})
    assert ok.status_code == 200 and ok.json()["count"] >= 1, ok.text


# ------------------------------------------------------------------ conformance (issue 48): beam search, truncation_side,
# every invalid logit_bias key in one error, /invocations answering as the endpoint it routes to

def _reference_beams(model_dir: str, prompt: list[int], width: int, max_tokens: int, end_ids: set[int],
                     length_penalty: float) -> list[tuple[list[int], str]]:
    """A straightforward beam search over HF transformers' log-softmax (vLLM's algorithm: each beam
    grows by its 2 x width best tokens, the best `width` live on, an end token completes a beam;
    score = cumulative logprob / length ** length_penalty, the end token not counted):
    [(output tokens without the end token, finish_reason)], best first."""
    import torch

    def score(beam):
        tokens, cum, ended = beam
        return cum / (len(tokens) - ended) ** length_penalty
    live, done = [(list(prompt), 0.0, False)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum, _ in live:
            top = torch.topk(hf_logprobs(model_dir, tokens)[-1], 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t in end_ids else grown).append((tokens + [t], cum + lp, t in end_ids))
        live = sorted(grown, key=score, reverse=True)[:width]
    best = sorted(done + live, key=score, reverse=True)[:width]
    return [(tokens[len(prompt):len(tokens) - ended], "stop" if ended else "length") for tokens, _, ended in best]


@pytest.mark.parametrize("length_penalty", [1.0, 0.25])
def test_beam_search_equals_a_reference_over_hf_logits(server, tiny_model_dir, length_penalty):
    """use_beam_search with n as the width, and length_penalty: the choices are the reference's beams,
    best first; a beam that reaches a stop token ends there (one of the step's third-best token here,
    so that ended and live beams compete, and length_penalty decides between them)."""
    import torch
    width, max_tokens = 2, 4
    first = torch.topk(hf_logprobs(tiny_model_dir, PROMPT_IDS)[-1], 2 * width).indices.tolist()
    end = {first[2]}
    ref = _reference_beams(tiny_model_dir, PROMPT_IDS, width, max_tokens, end, length_penalty)
    body = {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "n": width, "use_beam_search": True,
            "length_penalty": length_penalty, "stop_token_ids": sorted(end), "return_token_ids": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    got = [(c["token_ids"], c["finish_reason"]) for c in r.json()["choices"]]
    assert got == ref
    # streamed: the same choices (vLLM's beam search answers once, at the end)
    chunks = _sse(_post(server, "/v1/completions", {**body, "stream": True}, stream=True))
    streamed = {}
    for ch in chunks:
        for c in ch["choices"]:
            streamed.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    assert [streamed[i] for i in range(width)] == [t for t, _ in ref]


def test_beam_search_in_chat_and_its_best_beam_beats_greedy(server, tiny_model_dir, tok):
    """Chat with use_beam_search: the choices are the reference's beams; the best one's cumulative
    logprob is at least greedy's (the property every beam search must have)."""
    messages = [{"role": "user", "content": "Beautiful is better than"}]
    ids = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": True}).json()["tokens"]
    width, max_tokens = 3, 3
    ref = _reference_beams(tiny_model_dir, ids, width, max_tokens, set(), 1.0)
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "n": width,
                                               "use_beam_search": True, "ignore_eos": True,
                                               "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["token_ids"] for c in choices] == [t for t, _ in ref]
    assert choices[0]["message"]["content"] == tok.decode(ref[0][0], skip_special_tokens=True)

    def cumulative(out):
        lp = hf_logprobs(tiny_model_dir, ids + out)
        return sum(float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(out))
    greedy = hf_greedy(tiny_model_dir, ids, max_tokens)
    assert cumulative(choices[0]["token_ids"]) >= cumulative(greedy) - 1e-5
    bad = _post(server, "/v1/chat/completions", {"messages": messages, "use_beam_search": True, "max_tokens": 2,
                                                 "response_format": {"type": "json_object"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"


def test_truncation_side(server, tiny_model_dir):
    """truncation_side "right" keeps the prompt's first truncate_prompt_tokens tokens ("left", the
    default, the last); anything else is a 400 naming it."""
    long = list(range(20, 120))
    body = {"prompt": long, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "truncate_prompt_tokens": 10}
    right = _post(server, "/v1/completions", {**body, "truncation_side": "right"}).json()["choices"][0]
    assert right["prompt_token_ids"] == long[:10] and right["token_ids"] == hf_greedy(tiny_model_dir, long[:10], 3)
    left = _post(server, "/v1/completions", {**body, "truncation_side": "left"}).json()["choices"][0]
    assert left["prompt_token_ids"] == long[-10:]
    r = _post(server, "/v1/completions", {**body, "truncation_side": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"


def test_every_invalid_logit_bias_key_in_one_error(server):
    base = {"prompt": PROMPT_IDS, "max_tokens": 1}
    for bias, named in (({"a": 1, "1": 1, "b": 2}, ("'a'", "'b'")), ({"1000000": 1, "1000007": 1, "1": 1},
                                                                       ("1000000", "1000007")),
                        ({"1": 101, "2": -150, "3": 1}, ("101", "-150"))):
        r = _post(server, "/v1/completions", {**base, "logit_bias": bias})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "logit_bias", err
        assert all(n in err["message"] for n in named), err["message"]


def _shape(x):
    """A JSON value's keys and values all the way down, less what differs between two requests:
    ids, times, and how many prompt tokens were cached (the second request finds the first's)."""
    if isinstance(x, dict):
        return {k: "-" if k == "cached_tokens" else _shape(v) for k, v in x.items() if k not in ("id", "created")}
    if isinstance(x, list):
        return [_shape(v) for v in x]
    return x


def _stream_shape(chunks: list[dict]) -> tuple:
    """A stream's text (joined), its finish reasons, and the distinct shapes of its chunks (text and
    finish reason left out) in order of first appearance: equal for two streams of the same answer
    however it was chunked."""
    def text(c):
        return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or "" for ch in c.get("choices", []))

    def blank(x):
        if isinstance(x, dict):
            return {k: "-" if k in ("text", "content", "finish_reason") else blank(v) for k, v in x.items()}
        return [blank(v) for v in x] if isinstance(x, list) else x
    shapes = []
    for c in chunks:
        s = blank(_shape(c))
        if s not in shapes:
            shapes.append(s)
    reasons = [ch.get("finish_reason") for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    return "".join(text(c) for c in chunks), reasons, shapes


def test_invocations_answers_as_the_endpoint_it_routes_to(server):
    """/invocations: the same answer as /v1/chat/completions or /v1/completions, field for field
    (no service_tier, metadata, moderation or system_fingerprint that the endpoint does not send),
    whole and streamed."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": PROMPT_IDS})):
        body = {**body, "max_tokens": 3, "temperature": 0}
        direct, routed = _post(server, path, body), _post(server, "/invocations", body)
        assert routed.status_code == direct.status_code == 200
        assert _shape(routed.json()) == _shape(direct.json())
        assert routed.headers["Content-Type"] == direct.headers["Content-Type"]
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        d = _sse(_post(server, path, stream, stream=True))
        r = _sse(_post(server, "/invocations", stream, stream=True))
        # (how the tokens fall into chunks is timing: the engine may put two in one output)
        assert _stream_shape(r) == _stream_shape(d)
