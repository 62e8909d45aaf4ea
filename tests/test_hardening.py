"""One bad request never takes the server down (issue 10, part 1 and 3).

Every input that crashed the engine or got a 500 has a regression test here, over HTTP against
ONE real `loom serve` and over the engine protocol through a client attached to ONE headless
engine; afterwards both still answer, and a greedy request gives the same tokens as before.
Also: request-supplied chat templates are refused by default, one user's huge request does not
hold up another's small one, work queued for a client that has gone is skipped, and a large
input's tokenization (in the tokenizer process, frontend/openai/tokenizer_proc.py) is killed when its
client goes, with the same ids as in-process tokenization. An attached client's ABORT ends only
its own requests.
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
import msgspec
import pytest
import requests

from frontend.engine_client import EngineCoreClient
from ipc.messages import EngineCoreRequest, MultiModalItem
from ipc.sampling_params import SamplingParams, StructuredOutputsParams
from ipc.sockets import free_tcp_port
from tests.conftest import (child_pids, is_tokenizer_process, popen_serve, run_fake, run_to_end,
                            running_server, serve_processes)

KEY = "hardening-key"
MAX_MODEL_LEN = 256
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--enable-control-endpoints",
                        "--max-request-body-bytes", str(BODY_LIMIT)) as s:
        yield s


@pytest.fixture(scope="module")
def vocab_size(tiny_model_dir) -> int:
    with open(f"{tiny_model_dir}/config.json") as f:
        return json.load(f)["vocab_size"]


def _post(server, path: str, body=None, raw: bytes | None = None, timeout: float = 60):
    data = raw if raw is not None else json.dumps(body).encode()
    return requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"},
                         timeout=timeout)


def _greedy(server) -> str:
    r = _post(server, "/v1/completions", {"prompt": [11, 12, 13, 14], "max_tokens": 8, "temperature": 0,
                                          "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _crash_bodies(vocab: int):
    """(path, body or raw bytes, param) that crashed the engine or got a 500 before."""
    p = {"prompt": [11, 12, 13], "max_tokens": 2}
    m = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ("/v1/completions", {**p, "top_k": 2 ** 31}, "top_k"),
        ("/v1/completions", {**p, "top_k": 2 ** 64}, "top_k"),
        ("/v1/completions", {**p, "top_k": 2 ** 70}, "top_k"),
        ("/v1/chat/completions", {**m, "top_k": 2 ** 31}, "top_k"),
        ("/v1/completions", {**p, "seed": 2 ** 64}, "seed"),
        ("/v1/completions", {**p, "seed": 2 ** 63}, "seed"),
        ("/v1/completions", {**p, "seed": -2 ** 63 - 1}, "seed"),
        ("/v1/completions", {**p, "seed": 2 ** 80}, "seed"),
        ("/v1/completions", {**p, "logit_bias": {"-1": 5}}, "logit_bias"),
        ("/v1/completions", {**p, "logit_bias": {str(vocab): 5}}, "logit_bias"),
        ("/v1/completions", {**p, "logit_bias": {str(2 ** 70): 5}}, "logit_bias"),
        ("/v1/completions", {**p, "stop_token_ids": [vocab], "min_tokens": 1}, "stop_token_ids"),
        ("/v1/completions", {**p, "stop_token_ids": [-1], "min_tokens": 1}, "stop_token_ids"),
        ("/v1/completions", {**p, "n": 2 ** 40}, "n"),
        ("/v1/completions", {**p, "max_tokens": 2 ** 70}, "max_tokens"),
        ("/v1/completions", {**p, "min_tokens": 2 ** 70, "max_tokens": None}, "min_tokens"),
        ("/v1/completions", {**p, "logprobs": 2 ** 70}, "logprobs"),
        ("/v1/completions", {"prompt": [2 ** 70], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [-5, 1], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {**p, "stop": ["x"] * 2000}, "stop"),
        ("/v1/completions", {**p, "logit_bias": {str(i % vocab): 1 for i in range(2000)}}
         if vocab >= 2000 else {**p, "logit_bias": {str(-i): 1 for i in range(1, 2000)}}, "logit_bias"),
        ("/v1/completions", {"prompt": [[1, 2]] * 10_000, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["a"] * 600, "n": 2, "max_tokens": 1}, "n"),
        ("/v1/completions", {**p, "truncate_prompt_tokens": 2 ** 70}, "truncate_prompt_tokens"),
        ("/v1/completions", {**p, "repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32
        # valid alone, but together they leave no token to sample (a 500 once the worker found it)
        ("/v1/completions", {**p, "allowed_token_ids": [7], "min_tokens": 2, "stop_token_ids": [7]}, None),
        ("/v1/chat/completions", {**m, "allowed_token_ids": [7], "min_tokens": 2, "stop_token_ids": [7],
                                  "stream": True}, None),
        ("/collective_rpc", {"method": "ping", "args": [10 ** 40]}, None),  # past msgpack's 64 bits
        ("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 10 ** 20}, None),
        # nested 10,000 deep: in a field we read, one we ignore, and one we pass on
        ("/v1/completions", f'{{"prompt": {_nested(10_000)}}}'.encode(), None),
        ("/v1/completions", f'{{"prompt": "x", "unknown": {_nested(10_000)}}}'.encode(), None),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "x"}}], '
                                 f'"chat_template_kwargs": {{"a": {_nested(10_000)}}}}}'.encode(), None),
        ("/tokenize", f'{{"prompt": "x", "z": {_nested(10_000)}}}'.encode(), None),
        ("/collective_rpc", f'{{"method": "ping", "args": {_nested(10_000)}}}'.encode(), None),
        # invalid UTF-8
        ("/v1/completions", b'{"prompt": "\xff\xfe abc", "max_tokens": 2}', None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', None),
        ("/tokenize", b'{"prompt": "\xed\xa0\x80"}', None),
        ("/detokenize", b'{"tokens": [1], "model": "\xff"}', None),
        ("/invocations", b'{"prompt": "\xff"}', None),
        ("/invocations", f'{{"prompt": {_nested(10_000)}}}'.encode(), None),
    ]


def test_crash_inputs_get_400_over_http(server, vocab_size):
    before = _greedy(server)
    for path, body, param in _crash_bodies(vocab_size):
        t0 = time.monotonic()
        r = _post(server, path, raw=body) if isinstance(body, bytes) else _post(server, path, body)
        assert r.status_code == 400, (path, str(body)[:200], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError", err
        if param is not None:
            assert err["param"] == param, (body if not isinstance(body, bytes) else body[:80], err)
        assert time.monotonic() - t0 < 10, (path, "took too long")
        assert "Traceback" not in r.text and ".py" not in r.text
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
    assert _greedy(server) == before


def test_integers_at_the_limits_still_work(server, vocab_size):
    p = {"prompt": [11, 12, 13], "max_tokens": 2}
    for extra in ({"top_k": 2 ** 31 - 1}, {"top_k": -1}, {"seed": 2 ** 63 - 1}, {"seed": -2 ** 63},
                  {"logit_bias": {str(vocab_size - 1): 100, "0": -100}},
                  {"stop_token_ids": [vocab_size - 1], "min_tokens": 1}):
        r = _post(server, "/v1/completions", {**p, **extra})
        assert r.status_code == 200, (extra, r.text)
    # a subnormal temperature samples as vLLM's smallest (0.01): it made every score NaN, token 0
    # won, and a grammar then failed the request with a 500
    r = _post(server, "/v1/completions", {**p, "temperature": 1e-45, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def test_a_body_that_does_not_decode_as_its_content_encoding_is_400(server):
    r = requests.post(server.url + "/v1/completions", data=b"not gzip at all",
                      headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == 400 and "cannot be read" in r.json()["error"]["message"], r.text


def _raw_http(server, request: bytes) -> tuple[int, bytes]:
    """Send bytes no HTTP client library would; the status and body of the answer."""
    host, port = server.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /health HTTP/1.1 junk\r\n\r\n",
], ids=["header-too-long", "duplicate-content-length", "unknown-encoding", "bad-request-line"])
def test_requests_the_http_parser_refuses_get_openai_errors(server, request_bytes):
    """aiohttp answers these before any handler runs; the answer is still OpenAI's error shape."""
    status, body = _raw_http(server, request_bytes)
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"], body
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_body_size_limit(server):
    r = _post(server, "/v1/completions", {"prompt": "a" * (BODY_LIMIT + 10)})
    assert r.status_code == 413, r.text
    assert "--max-request-body-bytes" in r.json()["error"]["message"]
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_stream_options_without_stream_and_constraints(server):
    """Bad stream_options or constraints are 400s; good constraints run (tests/test_structured_outputs.py
    checks what they produce)."""
    p = {"prompt": "hi", "max_tokens": 2}
    m = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    cases = [
        ("/v1/completions", {**p, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {**m, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {**m, "response_format": {"type": "json_schema", "json_schema": {}}},
         "response_format"),
        ("/v1/completions", {**p, "structured_outputs": {"choice": []}}, "structured_outputs"),
        ("/v1/completions", {**p, "guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
        ("/v1/chat/completions", {**m, "tools": tools, "tool_choice": {"type": "function", "function": {
            "name": "g"}}}, "tool_choice"),
        ("/v1/chat/completions", {**m, "tools": tools}, "tool_choice"),   # auto needs --enable-auto-tool-choice
    ]
    for path, body, param in cases:
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    ok = [
        ("/v1/completions", {**p, "response_format": {"type": "text"}}),
        ("/v1/completions", {**p, "response_format": {"type": "json_object"}}),
        ("/v1/completions", {**p, "structured_outputs": {"choice": ["a", "b"]}}),
        ("/v1/chat/completions", {**m, "guided_json": {"type": "object"}}),
        ("/v1/completions", {**p, "guided_regex": "a+"}),
        ("/v1/chat/completions", {**m, "guided_grammar": "root ::= \"a\""}),
        ("/v1/chat/completions", {**m, "tools": tools, "tool_choice": "required"}),
        ("/v1/chat/completions", {**m, "tools": tools, "tool_choice": {"type": "function", "function": {
            "name": "f"}}}),
    ]
    for path, body in ok:
        r = _post(server, path, body)
        assert r.status_code == 200, (body, r.text)


def test_request_chat_template_refused_by_default(server):
    m = [{"role": "user", "content": "hi"}]
    evil = "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"
    for path, body in [("/v1/chat/completions", {"messages": m, "chat_template": evil}),
                       ("/v1/chat/completions", {"messages": m, "chat_template_kwargs": {"chat_template": evil}}),
                       ("/tokenize", {"messages": m, "chat_template": evil}),
                       ("/tokenize", {"messages": m, "chat_template_kwargs": {"chat_template": evil}})]:
        t0 = time.monotonic()
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5


def test_huge_requests_do_not_delay_a_small_one(server):
    """A 900 KB prompt (tokenized in the tokenizer process) and the most stop strings allowed, sent
    together: another user's small request is answered within 2 s meanwhile."""
    big_prompt = {"prompt": "lorem ipsum dolor " * 50_000, "max_tokens": 1}
    stops = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stop": [f"stop-{i}-" + "z" * 400
                                                                          for i in range(1024)]}
    results = {}

    def hammer(name, body):
        for _ in range(3):
            results.setdefault(name, []).append(_post(server, "/v1/completions", body).status_code)

    threads = [threading.Thread(target=hammer, args=("big", big_prompt)),
               threading.Thread(target=hammer, args=("stops", stops))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    worst = 0.0
    for _ in range(5):
        t0 = time.monotonic()
        r = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        worst = max(worst, time.monotonic() - t0)
        assert r.status_code == 200, r.text
    for t in threads:
        t.join(120)
    assert results["big"] == [400] * 3      # too long for --max-model-len, but tokenized to know it
    assert results["stops"] == [200] * 3
    assert worst < 2.0, f"a small request waited {worst:.2f}s behind huge ones"


def test_a_fan_out_does_not_make_another_user_wait(server):
    """Issue 54: while one request of 1,024 prompts x 200 tokens runs (256 is past this server's --max-model-len), another user's 8-token
    greedy completion finishes within 2 s (the engine shares its batch fairly between HTTP
    requests: engine_core/fairness.py; first come, first served made it wait 58 s)."""
    import asyncio

    import aiohttp

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def fan_out():
                async with session.post(server.url + "/v1/completions", json={
                        "prompt": ["Beautiful is"] * 1024, "max_tokens": 200, "ignore_eos": True}) as r:
                    return r.status
            big = asyncio.create_task(fan_out())
            await asyncio.sleep(1.5)   # its prompts fill the queue and the batch
            t0 = time.monotonic()
            async with session.post(server.url + "/v1/completions", json={
                    "prompt": [11, 12, 13, 14], "max_tokens": 8, "temperature": 0, "ignore_eos": True}) as r:
                body = await r.json()
            took = time.monotonic() - t0
            assert not big.done(), "the fan-out ended before the small request was sent"
            big.cancel()   # the client goes: its 1,024 requests are aborted
            return r.status, body, took

    status, body, took = asyncio.run(main())
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8
    print(f"an 8-token completion beside a 1,024-prompt fan-out: {took:.2f}s")
    assert took < 2.0, f"an 8-token completion waited {took:.2f}s behind another request's 1,024 prompts"
    _greedy(server)   # still serving


def test_tokenization_for_a_gone_client_is_skipped():
    """Queued tokenization of clients that have gone never runs (in-process, scripted engine)."""
    from tests.test_api_server import FakeLLM
    llm = FakeLLM(tokenizer_delay=0.0)
    calls = []
    encode = llm.tokenizer.encode

    def slow_encode(text, add_special_tokens=True):
        calls.append(len(text))
        time.sleep(1.0)
        return encode(text[:10], add_special_tokens)
    llm.tokenizer.encode = slow_encode

    async def scenario(session, url, llm):
        big = {"prompt": "x" * 100_000, "max_tokens": 1}   # the large lane: one at a time
        for _ in range(4):
            try:
                await session.post(url + "/v1/completions", json=big, timeout=aiohttp.ClientTimeout(total=0.2))
            except asyncio.TimeoutError:
                pass
        await asyncio.sleep(2.5)
        return list(calls)
    calls_seen = run_fake(llm, scenario)
    # the first started before its client left; the three queued behind it were cancelled
    assert len(calls_seen) <= 2, calls_seen


def _tokenizer_process(server) -> int | None:
    """The API server's tokenizer process (frontend/openai/tokenizer_proc.py), once a large input started it."""
    # (None while a replacement is starting: until it execs, its command line is the API server's,
    # and serve_processes takes the API server with that child for the engine core)
    api = serve_processes(server).get("api_server")
    return None if api is None else next((k for k in child_pids(api) if is_tokenizer_process(k)), None)


def test_large_inputs_tokenize_exactly_as_in_process(server, tiny_model_dir):
    """Inputs above the small lane's 64 KiB go through the tokenizer process: the same ids as the
    in-process tokenizer, for a prompt, a chat (its template included) and a list of prompts."""
    from transformers import AutoTokenizer
    from frontend.chat_utils import render_chat
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Zen of Python: é 😀 \u00e9 1234 " * 4000 + "the end"       # ~150 KB, not ASCII only
    r = _post(server, "/tokenize", {"prompt": text}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode(text)
    assert _tokenizer_process(server) is not None
    r = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    r = _post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == render_chat(tok, messages)[1]
    # a template error from the tokenizer process is the same 400
    r = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": True,
                                    "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    # a list of prompts, text and ids mixed: each is checked against --max-model-len with its own count
    r = _post(server, "/v1/completions", {"prompt": ["hi", text, [11, 12]], "max_tokens": 1})
    assert r.status_code == 400 and "prompt[1]" in r.json()["error"]["message"], r.text
    # (refused from a prefix, before it is tokenized in full: the count is a lower bound)
    assert "maximum context length is 256" in r.json()["error"]["message"], r.text


def test_the_tokenizer_process_holds_none_of_the_api_servers_descriptors(server):
    """Not the HTTP port's listening socket, nor the pipe by which `loom serve` sees its API
    server die: only its own stdin, stdout and stderr."""
    assert _post(server, "/tokenize", {"prompt": "x " * 70_000}, timeout=120).status_code == 200
    tokenizer = _tokenizer_process(server)
    assert tokenizer is not None
    held = {fd: os.readlink(f"/proc/{tokenizer}/fd/{fd}") for fd in os.listdir(f"/proc/{tokenizer}/fd")}
    leaked = {fd: what for fd, what in held.items() if int(fd) > 2 and what.startswith(("socket:", "pipe:"))}
    assert not leaked, held


def test_a_gone_clients_tokenization_is_killed(server):
    """A huge prompt's tokenization is killed when its client disconnects: the job stops at once,
    and the next huge request starts tokenizing at once instead of waiting for it to finish."""
    # ~1 MB: seconds of tokenizing (in full: it truncates, so it is not refused from a prefix)
    big = {"prompt": "lorem ipsum dolor " * 55_000, "max_tokens": 1, "truncate_prompt_tokens": 16}
    assert _post(server, "/v1/completions", big, timeout=120).status_code == 200   # starts the process
    zygote = _tokenizer_process(server)
    t0 = time.monotonic()
    assert _post(server, "/v1/completions", big, timeout=120).status_code == 200
    whole = time.monotonic() - t0          # one huge tokenization, start to end

    def job_running(timeout: float) -> float | None:
        """Seconds until the tokenizer process runs a job (a forked child), or None."""
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            if child_pids(zygote):
                return time.monotonic() - t
            time.sleep(0.005)
        return None

    def job_gone(timeout: float) -> float | None:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            if not child_pids(zygote):
                return time.monotonic() - t
            time.sleep(0.005)
        return None

    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps(big).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert job_running(30) is not None, "the huge prompt never reached the tokenizer process"
    sock.close()                           # the client goes away mid-tokenization
    killed = job_gone(whole)
    assert killed is not None and killed < min(0.5, whole / 3), (killed, whole)
    # the lane is free: a small request, and another huge one that starts tokenizing at once
    t0 = time.monotonic()
    assert _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2}).status_code == 200
    small = time.monotonic() - t0
    second = {}
    thread = threading.Thread(target=lambda: second.update(r=_post(server, "/v1/completions", big, timeout=120)))
    thread.start()
    started = job_running(whole)
    thread.join(120)
    assert second["r"].status_code == 200, second["r"].text
    assert small < 1.0, small
    assert started is not None and started < min(0.5, whole / 3), (started, whole)
    assert _tokenizer_process(server) == zygote   # killing a job does not restart the process


def test_a_dead_tokenizer_process_is_replaced(server):
    zygote = _tokenizer_process(server)
    if zygote is None:   # run alone: a large input starts it
        _post(server, "/tokenize", {"prompt": "x " * 40_000}, timeout=120)
        zygote = _tokenizer_process(server)
    os.kill(zygote, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while _tokenizer_process(server) in (None, zygote):
        assert time.monotonic() < deadline, "no new tokenizer process"
        time.sleep(0.1)
    r = _post(server, "/tokenize", {"prompt": "y " * 40_000}, timeout=120)
    assert r.status_code == 200 and r.json()["count"] >= 40_000, r.text
    assert _greedy(server)


# ------------------------------------------------------------------ the engine protocol

UNREAD_OUTPUTS_HWM = 32   # the engine's queue for an attached client's outputs (small: a test fills it)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = popen_serve(tiny_model_dir, "--headless", "--engine-address", address, "--engine-auth-key", KEY,
                       "--max-model-len", str(MAX_MODEL_LEN),
                       env={**os.environ, "LOOM_ATTACHED_OUTPUT_HWM": str(UNREAD_OUTPUTS_HWM)})
    client = None
    try:
        deadline = time.monotonic() + 180
        while client is None:
            try:
                client = EngineCoreClient.attach(address, KEY, timeout=2)
            except TimeoutError:
                assert proc.poll() is None and time.monotonic() < deadline, "headless engine did not start"
        yield client, proc, address
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _unchecked(**values) -> SamplingParams:
    """SamplingParams as a client that skips their checks sends them (their values set after they
    are made: SamplingParams refuses a bad value as it is made)."""
    params = SamplingParams()
    for name, value in values.items():
        setattr(params, name, value)
    return params


def test_sampling_params_refuse_bad_values_as_they_are_made():
    """As vLLM's: a ValueError naming the parameter when SamplingParams is made, not at generate()."""
    for values, param in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(top_k=2 ** 31), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
                          (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(seed=2 ** 64), "seed"),
                          (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(stop=[""]), "stop")):
        with pytest.raises(ValueError, match=param):
            SamplingParams(**values)
    assert SamplingParams(top_k=-1, stop="x").top_k == 0   # vLLM's forms still normalised


def test_crash_inputs_fail_alone_over_the_engine_protocol(engine, vocab_size):
    client, proc, _ = engine
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    before, _ = run_to_end(client, "before", [11, 12, 13, 14], SamplingParams(**greedy))
    bad = [
        ("top_k", [11, 12], _unchecked(top_k=2 ** 31), ()),
        ("top_k", [11, 12], _unchecked(top_k=2 ** 63), ()),
        ("logit_bias", [11, 12], _unchecked(logit_bias={-3: 1.0}, temperature=0), ()),
        ("logit_bias", [11, 12], _unchecked(logit_bias={vocab_size: 1.0}), ()),
        ("logit_bias", [11, 12], _unchecked(logit_bias={1: float("nan")}), ()),
        ("eos_token_ids", [11, 12], _unchecked(min_tokens=3, max_tokens=4), (vocab_size + 5,)),
        ("eos_token_ids", [11, 12], _unchecked(min_tokens=3, max_tokens=4), (-1,)),
        ("stop_token_ids", [11, 12], _unchecked(min_tokens=2, stop_token_ids=[vocab_size]), ()),
        ("seed", [11, 12], _unchecked(seed=2 ** 64 - 1), ()),
        ("seed", [11, 12], _unchecked(seed=-2 ** 63), ()),   # fits: must run
        ("prompt", [vocab_size], _unchecked(), ()),
        ("prompt", [-1, 3], _unchecked(), ()),
        ("prompt", [], _unchecked(), ()),
        ("prompt", [1] * MAX_MODEL_LEN, _unchecked(), ()),
        ("temperature", [11, 12], _unchecked(temperature=float("nan")), ()),
        ("temperature", [11, 12], _unchecked(temperature=float("inf")), ()),
        ("top_p", [11, 12], _unchecked(top_p=float("nan")), ()),
        ("repetition_penalty", [11, 12], _unchecked(repetition_penalty=float("inf")), ()),
        ("n", [11, 12], _unchecked(n=0), ()),
        ("max_tokens", [11, 12], _unchecked(max_tokens=0), ()),
        ("logprobs", [11, 12], _unchecked(logprobs=10 ** 6), ()),
        ("prompt_logprobs", [11, 12], _unchecked(prompt_logprobs=-2), ()),
        ("bad_words", [11, 12], _unchecked(bad_words=["cat"]), ()),   # strings: the client tokenizes
        ("bad_words", [11, 12], _unchecked(bad_words_token_ids=[[]]), ()),
        ("bad_words", [11, 12], _unchecked(bad_words_token_ids=[[1] * 33]), ()),
        ("bad_words_token_ids", [11, 12], _unchecked(bad_words_token_ids=[[3, vocab_size]]), ()),
        ("bad_words_token_ids", [11, 12], _unchecked(bad_words_token_ids=[[-1]]), ()),
        ("n must be 1", [11, 12], _unchecked(n=2), ()),   # a client fans n out (it once returned one)
    ]
    for i, (param, prompt, params, eos) in enumerate(bad):
        tokens, out = run_to_end(client, f"bad-{i}", prompt, params, eos)
        if param == "seed" and params.seed == -2 ** 63:
            assert out.finish_reason == "length" and out.error is None, out
            continue
        assert out.finish_reason == "error" and out.error and param in out.error, (param, out)
        assert tokens == []
    _, out = run_to_end(client, "x" * 1025, [11, 12], SamplingParams(max_tokens=2))   # echoed by every output
    assert out.finish_reason == "error" and "request_id must be at most 1024" in out.error, out.error[:100]
    # valid alone, but nothing left to sample together: each fails alone, with the reason in `error`
    for i, params in enumerate((SamplingParams(allowed_token_ids=[7], structured_outputs=StructuredOutputsParams(choice=["zzzz"])),
                                SamplingParams(allowed_token_ids=[7], min_tokens=2, stop_token_ids=[7]),
                                # top-p over a row with nothing left ended the engine (an empty cumsum)
                                SamplingParams(allowed_token_ids=[7], min_tokens=2, stop_token_ids=[7], top_p=0.5,
                                               temperature=1.0))):
        tokens, out = run_to_end(client, f"masked-{i}", [11, 12], params)
        assert out.finish_reason == "error" and "no token is left" in out.error and tokens == [], out
    # a schema holding a msgpack extension (decoded to an array, which JSON has no form for): its
    # size check raised TypeError, which ended the engine
    ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("<f4", [1], -1, b"\0" * 4)))
    _, out = run_to_end(client, "ext-json", [11, 12],
                        _unchecked(structured_outputs=StructuredOutputsParams(json={"type": ext})))
    assert out.finish_reason == "error" and "structured_outputs json" in out.error, out
    # a constraint that admits nothing: the token that broke it is not an output (error once None).
    # (xgrammar < 0.2.9 compiled the schema {"$ref": "#"} to such a grammar; 0.2.9 refuses it at
    # compile time, so an empty character class is the constraint that compiles and admits nothing)
    tokens, out = run_to_end(client, "no-token", [11, 12],
                             SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]")))
    assert out.finish_reason == "error" and "admits no token" in out.error and tokens == [], out
    tokens, out = run_to_end(client, "no-json", [11, 12],
                             SamplingParams(structured_outputs=StructuredOutputsParams(json={"$ref": "#"})))
    assert out.finish_reason == "error" and tokens == [], out   # admits no token, or does not compile
    # store handles that name no entry (a worker would release them), and a collective_rpc whose
    # kwargs a worker could not decode: each refused alone
    for i, (name, addr) in enumerate((("seg", 0), ("loom_mm_nosuch_c0", 128))):
        _, out = run_to_end(client, f"mm-{i}", [11, 12, 13], SamplingParams(max_tokens=2), (),
                            [MultiModalItem("image", "h", 0, 2, name, addr)])
        assert out.finish_reason == "error", out
    for level in (1.0, True, "1"):
        with pytest.raises(RuntimeError, match="level must be 0, 1 or 2"):
            client.call_utility("sleep", level)
    for kwargs in ([1], "abc", {1: 2}):
        with pytest.raises(RuntimeError, match="kwargs"):
            client.call_utility("collective_rpc", "ping", [], kwargs)
    assert proc.poll() is None
    assert client.call_utility("ping") == "pong"
    after, _ = run_to_end(client, "after", [11, 12, 13, 14], SamplingParams(**greedy))
    assert after == before
    info = client.call_utility("debug_info")
    assert info["tracked_requests"] == 0 and info["free_blocks"] == info["num_blocks"]


def test_a_client_that_does_not_read_its_outputs_is_dropped(engine, monkeypatch):
    """An attached client whose output socket is never read (a 4 KiB receive buffer, one message
    queued): once the kernel buffers and the engine's bounded queue are full, the engine drops
    it and aborts its requests, where it once queued every output in its own memory; the other
    clients are served throughout."""
    import zmq
    import frontend.engine_client as client_mod
    from frontend.engine_client import attach_handshake
    from ipc.sockets import make_socket
    good, proc, address = engine

    def unread_pull(ctx, kind, addr, bind, **kw):
        if kind != zmq.PULL:
            return make_socket(ctx, kind, addr, bind, **kw)
        sock = ctx.socket(zmq.PULL)   # options before bind: libzmq takes them at bind time
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        kw["auth"].apply(sock)
        sock.bind(addr)
        return sock

    monkeypatch.setattr(client_mod, "make_socket", unread_pull)
    slow = EngineCoreClient("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    monkeypatch.undo()
    try:
        attach_handshake(address, slow, KEY, 20)
        slow.wait_ready(20)
        clients = good.call_utility("debug_info")["clients"]
        prompt = [(j * 7) % 200 + 3 for j in range(MAX_MODEL_LEN - 8)]   # prompt logprobs: ~10 KB per output
        for i in range(200):
            slow.add_request(EngineCoreRequest(f"unread-{i}", prompt, SamplingParams(max_tokens=1, prompt_logprobs=5)))
        deadline = time.monotonic() + 60
        while good.call_utility("debug_info")["clients"] != clients - 1:
            assert time.monotonic() < deadline, "the client that reads nothing is still connected"
            assert run_to_end(good, f"served-{time.monotonic()}", [11, 12], SamplingParams(max_tokens=2))[1] \
                .finish_reason == "length"
            time.sleep(0.2)
        assert proc.poll() is None
        deadline = time.monotonic() + 30
        while good.call_utility("debug_info")["tracked_requests"]:
            assert time.monotonic() < deadline, "the dropped client's requests still run"
            time.sleep(0.1)
    finally:
        slow.close()


def test_a_client_aborts_only_its_own_requests(engine):
    """ABORT is scoped at the engine core to the client that added the request: a second attached
    client that names the first one's request id ends nothing, while its own abort works."""
    a, proc, address = engine
    b = EngineCoreClient.attach(address, KEY, timeout=10)
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        a.add_request(EngineCoreRequest("shared-id", [11, 12, 13], long, []))
        b.add_request(EngineCoreRequest("b-own", [11, 12], long, []))
        tokens = []
        while not tokens:   # A's request is running
            outs = a.get_outputs(timeout=60)
            assert outs is not None, "no output within 60 s"
            tokens += [t for o in outs.outputs if o.request_id == "shared-id" for t in o.new_token_ids]
        b.abort(["shared-id", "b-own"])
        b.add_request(EngineCoreRequest("shared-id", [11, 12], SamplingParams(max_tokens=2), []))  # A's id: refused
        # in order after B's messages: B's own request is gone, A's still runs
        assert b.call_utility("debug_info", timeout=30)["tracked_requests"] == 1
        refused = None
        while refused is None:
            outs = b.get_outputs(timeout=30)
            assert outs is not None, "no answer to B's ADD"
            refused = next((o for o in outs.outputs if o.request_id == "shared-id"), None)
        assert refused.finish_reason == "error" and "already in use" in refused.error, refused
        finish = None
        while finish is None:
            outs = a.get_outputs(timeout=60)
            assert outs is not None, "A's request stopped producing output"
            for o in outs.outputs:
                if o.request_id == "shared-id":
                    tokens += o.new_token_ids
                    finish = o.finish_reason
        assert finish == "length" and len(tokens) == 200, (finish, len(tokens))
    finally:
        b.close()
    assert proc.poll() is None


# ------------------------------------------------------------------ fuzzing every endpoint's fields

_FUZZ_BUDGET_S = 50.0
_ENDPOINTS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop",
                        "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "echo", "logit_bias",
                        "presence_penalty", "frequency_penalty", "repetition_penalty", "stream", "stream_options",
                        "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
                        "truncate_prompt_tokens", "include_stop_str_in_output", "skip_special_tokens", "best_of",
                        "suffix", "add_special_tokens", "response_format", "model", "user", "guided_regex",
                        "bad_words", "allowed_token_ids"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_k", "seed", "n",
                             "logprobs", "top_logprobs", "stop", "stream", "stream_options", "echo", "tools",
                             "tool_choice", "add_generation_prompt", "continue_final_message", "chat_template",
                             "chat_template_kwargs", "prompt_logprobs", "return_token_ids", "logit_bias",
                             "min_tokens", "response_format", "model", "bad_words"],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                  "chat_template_kwargs", "model"],
    "/detokenize": ["tokens", "model"],
    "/invocations": ["prompt", "messages", "max_tokens", "stream", "temperature"],
    "/collective_rpc": ["method", "args", "kwargs", "timeout"],
}


def _fuzz_values():
    from hypothesis import strategies as st
    scalars = st.one_of(
        st.none(), st.booleans(),
        st.sampled_from([0, 1, 2, 3, -1, -2, 7, 255, 256, 2 ** 31 - 1, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1,
                         2 ** 100, 10 ** 6]),
        st.integers(-300, 300),
        st.floats(allow_nan=False, allow_infinity=False, width=64),
        st.sampled_from([0.0, 0.5, 1.0, 1e308, -1e-9, 2.0, 100.0]),
        st.text(max_size=12), st.sampled_from(["", "hi", "text", "user", "assistant", "wizard", "ping", "sleep",
                                               "required", "auto", "none", "json_object", "\u0000", "\ud7ff"]))
    tree = st.recursive(scalars, lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage",
                                         "continuous_usage_stats", "1", "-1", "99999", "name", "x"]), kids,
                        max_size=4)), max_leaves=12)
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool",
                                                                        "bad"]),
                                               "content": st.one_of(st.text(max_size=20), tree)}),
                        max_size=3)
    return tree, messages


def test_fuzz_every_endpoint(server):
    """Random bodies, field by field, to every POST endpoint: always 2xx or 4xx in OpenAI's error
    shape, never a 5xx or a hang; afterwards a greedy request gives the same text as before."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    tree, messages = _fuzz_values()
    before = _greedy(server)
    start = time.monotonic()
    seen = {"requests": 0}

    body = st.sampled_from(sorted(_ENDPOINTS)).flatmap(lambda path: st.tuples(st.just(path), st.one_of(
        st.fixed_dictionaries({}, optional={f: (messages if f == "messages" else tree) for f in _ENDPOINTS[path]}),
        st.binary(max_size=40))))

    @settings(max_examples=400, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(body)
    def one(case):
        if time.monotonic() - start > _FUZZ_BUDGET_S:
            return
        path, payload = case
        if isinstance(payload, dict) and isinstance(payload.get("max_tokens"), int) and payload["max_tokens"] > 8:
            payload["max_tokens"] = 8      # keep the CPU work of one case small; range checks are above
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        r = requests.post(server.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
        seen["requests"] += 1
        body_text = r.text     # a stream is read to its end here
        assert r.status_code < 500, (path, raw[:300], r.status_code, body_text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["code"] == r.status_code and isinstance(err["message"], str), body_text
        elif r.headers.get("Content-Type", "").startswith("text/event-stream"):
            assert body_text.rstrip().endswith("data: [DONE]"), body_text[-200:]
            assert '"code":5' not in body_text, body_text[-300:]
    one()
    assert seen["requests"] >= 50
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
    assert _greedy(server) == before


def test_seeds_of_n_choices_stay_in_64_bits():
    from frontend.processing import engine_requests
    from ipc.validation import Limits, validate_request
    params = SamplingParams(n=3, seed=2 ** 63 - 2)
    seeds = [r.sampling_params.seed for r in engine_requests("r", [1, 2], params, [], 0.0)]
    assert seeds == [2 ** 63 - 2, 2 ** 63 - 1, -2 ** 63]
    for r in engine_requests("r", [1, 2], params, [], 0.0):
        validate_request(r.prompt_token_ids, r.sampling_params, Limits(100, 64))


def test_error_bodies_carry_no_tracebacks():
    """A 500 and a dead engine's 503 tell the client what happened, never code or file paths."""
    from frontend.errors import engine_dead_message
    from tests.test_api_server import FakeLLM
    tb = ('engine core failed: worker 0: Traceback (most recent call last):\n  File "/srv/loom/workers/'
          'model_runner.py", line 9, in launch\n    x = y[3]\nIndexError: index 3 is out of bounds')
    assert engine_dead_message(tb) == "The engine is dead: IndexError: index 3 is out of bounds"

    class Broken(FakeLLM):
        async def generate(self, prompt_token_ids, params, request_id, **options):
            raise KeyError("/secret/path/file.py")
            yield

    async def scenario(session, url, llm):
        async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            crash = (r.status, await r.text())
        llm.dead_reason = tb
        async with session.get(url + "/health") as r:
            dead = (r.status, await r.text())
        return crash, dead
    (status, text), (dead_status, dead_text) = run_fake(Broken(), scenario)
    assert status == 500 and "/secret" not in text and "KeyError" not in text, text
    assert dead_status == 503 and "File" not in dead_text and "IndexError" in dead_text


def test_token_id_check_refuses_exactly_the_ids_outside_the_vocabulary():
    """check_token_ids' one-pass check (msgspec) and its min()/max() fallback: an error, naming
    every bad id, exactly when some id lies outside [0, vocab); bools, floats and tuples as before."""
    from ipc.validation import RequestError, check_token_ids
    for ids in ([0, 9], [10], [-1], [3, 10, -2, 4, 11], [True, 9], [1.5, 2], [2 ** 70], (1, 2), (1, 12), [9] * 3000):
        bad = [t for t in ids if not 0 <= t < 10]
        if bad:
            with pytest.raises(RequestError, match=", ".join(map(str, bad[:50]))):
                check_token_ids("prompt", ids, 10)
        else:
            check_token_ids("prompt", ids, 10)
