"""The OpenAI-compatible HTTP server.

Part 1 runs `frontend.openai.api_server.serve` in-process against a scripted fake
AsyncLLM (fast, deterministic): engine death before and during a stream,
client disconnects aborting, tokenization off the event loop.

Part 2 runs a REAL `loom serve` process on a tiny random Qwen3 model and talks
to it with the official `openai` client and plain HTTP.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time

import aiohttp
import openai
import pytest
import requests

from ipc.config import EngineConfig
from frontend.openai.api_server import serve
from frontend.errors import EngineDeadError
from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from tests.conftest import openai_client, run_fake, running_server

# ======================================================================= part 1: fake engine


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    def __len__(self):
        return 1000

    def encode(self, text, add_special_tokens=True):
        if self.delay:
            time.sleep(self.delay)
        return [ord(c) % 1000 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + ("[assistant]" if add_generation_prompt
                                                                            else "")


class FakeLLM:
    """Yields one token ("a", "b", ...) every `step` seconds; `die_after` tokens then the engine dies."""

    def __init__(self, step: float = 0.0, die_after: int | None = None, tokenizer_delay: float = 0.0):
        self.config = EngineConfig(model="fake", max_model_len=4096, vocab_size=1000)
        self.tokenizer = FakeTokenizer(tokenizer_delay)
        self.client_index = 0
        self.step = step
        self.die_after = die_after
        self.dead_reason: str | None = None
        self.closed: list[str] = []       # request ids whose generator ended without finishing
        self.finished: list[str] = []
        self.started = asyncio.Event()

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def generate(self, prompt_token_ids, params, request_id, **options):
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        done = False
        try:
            self.started.set()
            for i in range(params.max_tokens or 1000):
                await asyncio.sleep(self.step)
                if self.die_after is not None and i >= self.die_after:
                    self.dead_reason = "worker 0 died"
                    raise EngineDeadError(self.dead_reason)
                last = i == (params.max_tokens or 1000) - 1
                tok = 97 + i % 26
                outs = [CompletionOutput(j, chr(tok), [tok], "length" if last else None, None,
                                         [{tok: Logprob(-0.5, 1, chr(tok))}] if params.logprobs is not None
                                         else None)
                        for j in range(params.n)]
                done = last
                yield RequestOutput(request_id, None, prompt_token_ids, outs, finished=last)
        finally:
            (self.finished if done else self.closed).append(request_id)

    async def abort(self, request_id):
        self.closed.append(request_id)

    async def call_utility(self, method, *args):
        return True


def test_fake_completion_and_chat_shapes():
    async def scenario(s, url, llm):
        async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2}) as r:
            body = await r.json()
            assert r.status == 200, body
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert [c["text"] for c in body["choices"]] == ["abc", "abc"]
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
        async with s.post(url + "/v1/completions", json={"prompt": ["hi", "there"], "max_tokens": 2}) as r:
            body = await r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 7
        async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True}) as r:
            assert (await r.json())["choices"][0]["text"] == "hiab"
        async with s.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True, "n": 2,
                "stream_options": {"include_usage": True}}) as r:
            raw = (await r.read()).decode()
        events = [e[len("data: "):] for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        finals = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
        assert sorted(f["index"] for f in finals) == [0, 1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    run_fake(FakeLLM(), scenario)


def test_fake_engine_dead_health_and_new_requests():
    async def scenario(s, url, llm):
        async with s.get(url + "/health") as r:
            assert r.status == 200
        llm.dead_reason = "engine core exited"
        async with s.get(url + "/health") as r:
            assert r.status == 503
            assert "engine core exited" in (await r.json())["error"]["message"]
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            async with s.post(url + path, json={**body, "stream": True}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == 503
    run_fake(FakeLLM(), scenario)


@pytest.mark.parametrize("stream", [True, False])
def test_fake_engine_dies_mid_request(stream):
    async def scenario(s, url, llm):
        t0 = time.monotonic()
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": stream}) as r:
            raw = await asyncio.wait_for(r.read(), 10)
            status = r.status
        assert time.monotonic() - t0 < 5
        if not stream:
            assert status == 503 and json.loads(raw)["error"]["code"] == 503
            return
        assert status == 200
        events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e]
        datas = [json.loads(e) for e in events if e != "[DONE]"]
        assert [d["choices"][0]["text"] for d in datas[:-1]] == ["a", "b", "c"]
        assert datas[-1]["error"]["code"] == 503 and "worker 0 died" in datas[-1]["error"]["message"]
    run_fake(FakeLLM(step=0.01, die_after=3), scenario)


@pytest.mark.parametrize("stream", [True, False])
def test_fake_client_disconnect_aborts(stream):
    async def scenario(s, url, llm):
        req = asyncio.create_task(s.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": stream}))
        if stream:
            r = await req
            await r.content.readuntil(b"\n\n")   # the role chunk
            r.close()                             # drop the connection mid-stream
        else:
            await asyncio.wait_for(llm.started.wait(), 5)
            req.cancel()                          # drop the connection while waiting for the response
            await asyncio.gather(req, return_exceptions=True)
        for _ in range(200):
            if llm.closed:
                break
            await asyncio.sleep(0.01)
        assert llm.closed and not llm.finished
    run_fake(FakeLLM(step=0.01), scenario)


def test_fake_tokenization_does_not_block_health():
    async def scenario(s, url, llm):
        async def slow():
            async with s.post(url + "/tokenize", json={"prompt": "x" * 10}) as r:
                return await r.json()
        task = asyncio.create_task(slow())       # the tokenizer takes 1 s
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        async with s.get(url + "/health") as r:
            assert r.status == 200
        assert time.monotonic() - t0 < 0.5
        assert (await task)["count"] == 10
    run_fake(FakeLLM(tokenizer_delay=1.0), scenario)


def test_fake_api_key_and_control_endpoints():
    async def scenario(s, url, llm):
        async with s.get(url + "/v1/models") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == 401
        async with s.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        # a key that is not UTF-8 (it was a 500)
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                     b"Connection: close\r\n\r\n")
        assert (await reader.readline()).split()[1] == b"401"
        writer.close()
        async with s.get(url + "/health") as r:
            assert r.status == 200
        auth = {"Authorization": "Bearer sekrit"}
        async with s.get(url + "/v1/models", headers=auth) as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake"
        async with s.post(url + "/reset_prefix_cache", headers=auth) as r:
            assert r.status == 200
    run_fake(FakeLLM(), scenario, api_key="sekrit", enable_control_endpoints=True)


def test_fake_shared_listening_socket():
    """The launcher hands several API servers one bound socket (web.SockSite)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]

    async def main():
        ready = asyncio.Event()
        task = asyncio.create_task(serve(FakeLLM(), sock=sock, ready=ready))
        await asyncio.wait_for(ready.wait(), 10)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/version") as r:
                    assert r.status == 200 and "version" in await r.json()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


# ======================================================================= part 2: real `loom serve`

from tests.conftest import Server  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("qwen3")


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--max-model-len", "128") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


PROMPT = "Beautiful is better than"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


def test_health_models_version(server, model_dir, model_name):
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and len(models["data"]) == 1
    assert models["data"][0]["object"] == "model" and model_name == model_dir
    assert models["data"][0]["max_model_len"] == 128
    assert models["data"][0]["quantization"] is None   # the weights' method (vLLM's --quantization name)
    assert requests.get(server.url + "/version", timeout=10).json()["version"]
    one = requests.get(server.url + "/v1/models/" + model_name.lstrip("/"), timeout=10)
    assert one.status_code == 404   # a leading "/" is part of the id
    one = requests.get(server.url + "/v1/models/" + model_name, timeout=10)
    assert one.status_code == 200 and one.json()["id"] == model_name


def test_models_via_openai_client(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_completion_stream_equals_nonstream_and_usage(client, model_name, hf_tokenizer):
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == model_name
    [choice] = full.choices
    assert choice.finish_reason == "length" and choice.index == 0
    n_prompt = len(hf_tokenizer.encode(PROMPT))
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == n_prompt + 24

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_equals_nonstream_and_usage(client, model_name, hf_tokenizer):
    kw = dict(model=model_name, messages=MESSAGES, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    [choice] = full.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt_ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    n_prompt = len(hf_tokenizer.encode(prompt_ids, add_special_tokens=False))
    assert full.usage.prompt_tokens == n_prompt and full.usage.completion_tokens == 20

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == n_prompt


def test_chat_content_parts_and_max_completion_tokens(client, model_name):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"},
                                          {"type": "text", "text": "about a cat."}]}]
    r = client.chat.completions.create(model=model_name, messages=parts, max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_chat_default_max_tokens_is_up_to_max_model_len(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 128


def test_token_id_prompt_and_batch(client, model_name, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    kw = dict(model=model_name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert client.completions.create(prompt=ids, **kw).choices[0].text == by_text
    batch = client.completions.create(prompt=[PROMPT, "Hello world"], **kw)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text
    assert batch.usage.prompt_tokens == len(ids) + len(hf_tokenizer.encode("Hello world"))
    assert batch.usage.completion_tokens == 12
    streamed = {}
    for c in client.completions.create(prompt=[ids, "Hello world"], stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: by_text, 1: batch.choices[1].text}


def test_n_choices(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 15
    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, n=2,
                                                 stream=True, temperature=0))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_seed_reproducible(client, model_name):
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string(client, model_name):
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = next((text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isprintable()
                 and text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.skip("the random model produced no usable stop string")
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw)
                       if c.choices)
    assert streamed == r.choices[0].text


def test_completion_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 1 <= len(top) <= 4   # keyed by token text: tokens decoding alike collapse
        assert max(top.values()) == pytest.approx(tlp, abs=1e-4)   # greedy: the sampled token is the best
    assert lp.text_offset == sorted(lp.text_offset)
    r0 = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    assert all(len(t) == 1 for t in r0.choices[0].logprobs.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert sum(len(s.tokens) for s in streamed) == 4
    assert [t for s in streamed for t in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list) and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert all(i.top_logprobs == [] for i in r.choices[0].logprobs.content)


def test_concurrent_streams_match(client, model_name):
    kw = dict(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    expected = client.chat.completions.create(**kw).choices[0].message.content
    results: list = [None] * 4

    def one(i):
        results[i] = "".join(c.choices[0].delta.content or "" for c in
                             client.chat.completions.create(stream=True, **kw) if c.choices)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [expected] * 4


def test_tokenize_detokenize(server, hf_tokenizer):
    r = requests.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()
    assert r["tokens"] == hf_tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 128
    d = requests.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert d == {"prompt": PROMPT}
    chat = requests.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=10).json()
    text = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
    no_gen = requests.post(server.url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False},
                           timeout=10).json()
    assert no_gen["count"] < chat["count"]


def _post(server, path, body, raw: bytes | None = None, method="POST"):
    return requests.request(method, server.url + path, data=raw if raw is not None else json.dumps(body),
                            headers={"Content-Type": "application/json"}, timeout=30)


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.01}, 400, "top_p"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello " * 200}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 125}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1000}, 400, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "nope", "stream": True}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    # an image for a text-only model: refused, as a chat request is (its part was silently dropped)
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "nope"}]}, 400, "tools"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_requests(server, client, model_name, path, body, status, param):
    for stream in ((False, True) if path.startswith("/v1/") else (None,)):
        payload = dict(body) if stream is None else {**body, "stream": stream}
        r = _post(server, path, payload)
        assert r.status_code == status, (payload, r.text)
        err = r.json()["error"]
        assert err["code"] == status and err["message"] and err["type"]
        assert err["param"] == param, err
    # and the server keeps serving
    ok = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_bad_request_error_types(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0)
    assert ei.value.status_code == 400 and ei.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="does-not-exist", messages=MESSAGES)
    assert "The model `does-not-exist` does not exist." in str(ei.value)
    r = _post(server, "/v1/completions", None, raw=b"{this is not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = requests.get(server.url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = requests.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


# ----------------------------------------------------------------------- a second server: api key,
# ----------------------------------------------------------------------- disconnects, engine death

@pytest.fixture(scope="module")
def aux_server(model_dir):
    """One request at a time: an un-aborted request would hold up the next one."""
    with running_server(model_dir, "--api-key", "sekrit", "--max-num-seqs", "1", "--max-model-len", "512") as s:
        yield s


AUTH = {"Authorization": "Bearer sekrit"}


def test_api_key(aux_server):
    url = aux_server.url
    assert requests.get(url + "/health", timeout=10).status_code == 200
    for path, method in (("/v1/models", "GET"), ("/version", "GET"), ("/v1/completions", "POST"),
                         ("/tokenize", "POST")):
        r = requests.request(method, url + path, json={"prompt": "x"}, timeout=10)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == 401
        r = requests.request(method, url + path, json={"prompt": "x"}, timeout=10,
                             headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    c = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    c = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
    assert len(c.models.list().data) == 1
    assert c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=2).usage


def _quick_request_time(url) -> float:
    t0 = time.monotonic()
    r = requests.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def long_time(aux_server) -> float:
    """How long 100 generated tokens take on aux_server."""
    t0 = time.monotonic()
    r = requests.post(aux_server.url + "/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 100
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(aux_server, long_time, stream):
    """With --max-num-seqs 1, the request after a dropped one runs at once only if the dropped one was aborted."""
    url = aux_server.url
    host, port = "127.0.0.1", aux_server.port
    body = json.dumps({"prompt": PROMPT, "max_tokens": 450, "ignore_eos": True, "stream": stream}).encode()
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        assert sock.recv(200).startswith(b"HTTP/1.1 200")
    else:
        time.sleep(0.3)
    sock.close()
    quick = _quick_request_time(url)
    # 450 tokens take > 4x as long as the 100 of long_time; an aborted request takes nothing
    assert quick < max(long_time * 0.5, 0.5), (quick, long_time)


def _engine_core_pid(server: Server) -> int:
    """The launcher's child that has children of its own (the workers)."""
    def children(pid):
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    for child in children(server.proc.pid):
        cmd = open(f"/proc/{child}/cmdline", "rb").read()
        if b"resource_tracker" not in cmd and children(child):
            return child
    raise RuntimeError("no engine core process found")


def test_engine_death_mid_stream(aux_server):
    """Runs last on aux_server: kills its engine core while a stream is open."""
    url = aux_server.url
    engine_core = _engine_core_pid(aux_server)   # (before the stream: its ps calls can outlast 450 tokens on a busy box)
    r = requests.post(url + "/v1/completions", stream=True, headers=AUTH, timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 450, "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    lines = r.iter_lines()
    first = next(line for line in lines if line)
    assert first.startswith(b"data: {")
    os.kill(engine_core, signal.SIGKILL)
    t0 = time.monotonic()
    events = []
    try:
        for line in lines:
            if line:
                events.append(line)
    except requests.exceptions.ChunkedEncodingError:
        pass  # the launcher may take the API server down right after
    assert time.monotonic() - t0 < 20
    errors = [json.loads(e[6:]) for e in events if e.startswith(b"data: {\"error\"")]
    assert errors and errors[0]["error"]["code"] in (500, 503), events[-3:]


def test_image_sent_to_a_text_only_model_is_400(client, model_name):
    """A text-only model takes no image_url part: OpenAI's 400, and the server keeps serving."""
    url = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGA"
           "hKmMIQAAAABJRU5ErkJggg==")
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "hi"}]}]
    with pytest.raises(openai.BadRequestError, match="does not take images") as e:
        client.chat.completions.create(model=model_name, messages=msg, max_tokens=2)
    assert e.value.status_code == 400
    assert client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices


def test_malformed_http_is_a_4xx_without_an_error_in_the_log(caplog):
    """A body that does not decode as its Content-Encoding, and bytes aiohttp's parser refuses, are
    OpenAI-shaped 400s, logged below ERROR: any client could fill the log with tracebacks (aiohttp
    logged each one, the first twice), and the server answers the next request."""
    import asyncio
    import logging

    async def raw(url: str, data: bytes) -> bytes:
        host, port = url.split("//")[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(data)
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return answer

    async def scenario(s, url, llm):
        async with s.post(url + "/v1/completions", data=b"not gzip",
                          headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
            assert r.status == 400 and "cannot be read" in (await r.json())["error"]["message"]
        for bad in (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
                    b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"):
            answer = await raw(url, bad)
            assert answer.split(b" ", 2)[1] == b"400" and b'"error"' in answer, answer
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
        await asyncio.sleep(0.2)   # aiohttp's lingering read of the broken body, where it logged again

    with caplog.at_level(logging.DEBUG):
        run_fake(FakeLLM(), scenario)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
