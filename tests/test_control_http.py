"""Control endpoints over HTTP (sleep / wake_up / pause / resume / collective_rpc) and several
API-server processes sharing one port, against real `loom serve` processes.

Two servers start together (start-up dominates the run time):
  `one`:   --enable-control-endpoints, one API server, no sleep mode
  `multi`: --enable-control-endpoints --enable-sleep-mode --api-server-count 3 --api-key
`multi` is killed by the last test. Streams are read with aiohttp: it hands each SSE line over as it
arrives (requests' iter_lines buffers), which the "nothing arrives while paused" checks rely on.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from tests.conftest import Server, child_pids, run_fake, shm_entries

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
INDEX = "X-Loom-Server-Index"
PROMPT = "Beautiful is better than"
GREEDY = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
TIMEOUT = aiohttp.ClientTimeout(total=60)


@pytest.fixture(scope="module")
def servers(model_factory):
    model = model_factory("qwen3")
    # One OpenMP thread per worker: on a busy machine, OpenMP's spin-waiting threads made the
    # 200-request test ~10x slower (20 s instead of 2 s).
    env = {"OMP_NUM_THREADS": "1"}
    one = Server(model, "--enable-control-endpoints", "--max-model-len", "512", env=env)
    multi = Server(model, "--enable-control-endpoints", "--enable-sleep-mode", "--api-server-count", "3",
                   "--api-key", KEY, "--max-model-len", "512", env=env)
    try:
        one.wait_healthy(180)
        multi.wait_healthy(180)
        # all three API servers up before any test: their start-up would compete for the CPU
        run(lambda s: _indexes_seen(s, multi.url, "/health", timeout=120), fresh_connections=True)
        yield one, multi
    finally:
        one.stop()
        multi.stop()


@pytest.fixture(scope="module")
def one(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def multi(servers) -> Server:
    return servers[1]


def run(coro_fn, *args, fresh_connections: bool = False):
    """asyncio.run(coro_fn(session, *args)) with a client session (no keep-alive if asked)."""
    async def main():
        conn = aiohttp.TCPConnector(force_close=fresh_connections, limit=64)
        async with aiohttp.ClientSession(connector=conn, timeout=TIMEOUT) as s:
            return await coro_fn(s, *args)
    return asyncio.run(main())


class Stream:
    def __init__(self):
        self.texts: list[str] = []
        self.times: list[float] = []
        self.finish: str | None = None
        self.index: str | None = None
        self.done = False

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def stream_completion(s, url: str, body: dict, headers=None, st: Stream | None = None) -> Stream:
    st = st if st is not None else Stream()
    async with s.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status == 200, await r.text()
        st.index = r.headers.get(INDEX)
        async for line in r.content:
            line = line.strip()
            if not line:
                continue
            if line == b"data: [DONE]":
                break
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            choice = ev["choices"][0]
            st.texts.append(choice["text"])
            st.times.append(time.monotonic())
            st.finish = choice["finish_reason"] or st.finish
    st.done = True
    return st


async def complete(s, url: str, body: dict, headers=None) -> str:
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def call(s, method: str, url: str, headers=None, **kw) -> tuple[int, dict]:
    async with s.request(method, url, headers=headers, **kw) as r:
        return r.status, await r.json()


async def until(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


# ======================================================================= one API server

def test_bad_values_and_rpc(one):
    async def scenario(s, url):
        for path, param, words in (("/sleep?level=7", "level", "'level' must be one of 0, 1, 2"),
                                   ("/sleep?level=x", "level", "'level'"),
                                   ("/pause?mode=x", "mode", "'mode' must be one of abort, wait, keep"),
                                   ("/pause?mode=keep&clear_cache=maybe", "clear_cache", "true or false"),
                                   ("/pause?wait_for_inflight_requests=maybe", "wait_for_inflight_requests",
                                    "true or false"),
                                   ("/pause?mode=abort&wait_for_inflight_requests=true",
                                    "wait_for_inflight_requests", "contradicts mode=abort"),
                                   ("/wake_up?tags=weights&tags=foo", "tags", "unknown tags ['foo']"),
                                   ("/sleep?level=1", "level", "--enable-sleep-mode"),
                                   ("/sleep?level=2", "level", "--enable-sleep-mode")):
            status, body = await call(s, "POST", url + path)
            assert status == 400, (path, body)
            assert body["error"]["code"] == 400 and body["error"]["param"] == param, body
            assert words in body["error"]["message"], body
        for rpc, words in (({"method": "__init__"}, "not callable on workers"),
                           ({"method": "runner"}, "not callable on workers"),
                           ({"method": "call", "args": []}, "not callable on workers"),
                           ({"method": "shutdown"}, "not allowed"),
                           ({"method": "sleep", "args": [1]}, "not allowed"),
                           ({"method": "ping", "args": [1, 2]}, "argument"),       # TypeError in the worker
                           ({"method": "ping", "timeout": -1}, "'timeout'"),
                           ({"args": []}, "method"),
                           ({"method": "ping", "bogus": 1}, "bogus")):
            status, body = await call(s, "POST", url + "/collective_rpc", json=rpc)
            assert status == 400 and body["error"]["code"] == 400, (rpc, body)
            assert words in body["error"]["message"], (rpc, body)
        assert await call(s, "POST", url + "/collective_rpc", json={"method": "ping", "timeout": 10}) == \
            (200, {"results": ["pong"]})
        # nothing above put the engine in a bad state
        assert await call(s, "GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
        assert await call(s, "GET", url + "/is_paused") == (200, {"is_paused": False})
        assert len(await complete(s, url, {**GREEDY, "max_tokens": 3})) > 0
    run(scenario, one.url)


def test_sleep_level0_holds_requests_until_wake_up(one):
    async def scenario(s, url):
        assert await call(s, "POST", url + "/sleep?level=0") == (200, {"status": "ok"})
        assert await call(s, "GET", url + "/is_sleeping") == (200, {"is_sleeping": True})
        pending = asyncio.create_task(complete(s, url, {**GREEDY, "max_tokens": 4}))
        await asyncio.sleep(1.0)
        assert not pending.done()
        assert await call(s, "POST", url + "/wake_up?tags=scheduling") == (200, {"status": "ok"})
        assert len(await asyncio.wait_for(pending, 30)) > 0
        assert await call(s, "GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
    run(scenario, one.url)


def test_pause_abort_then_queue_until_resume(one):
    async def scenario(s, url):
        st = Stream()
        task = asyncio.create_task(stream_completion(s, url, {**GREEDY, "max_tokens": 300}, st=st))
        await until(lambda: len(st.texts) >= 3)
        assert await call(s, "POST", url + "/pause?mode=abort") == (200, {"status": "ok"})
        await asyncio.wait_for(task, 10)
        assert st.finish == "abort" and len(st.texts) < 300
        assert await call(s, "GET", url + "/is_paused") == (200, {"is_paused": True})
        pending = asyncio.create_task(complete(s, url, {**GREEDY, "max_tokens": 4}))
        await asyncio.sleep(0.8)
        assert not pending.done()
        assert await call(s, "POST", url + "/resume") == (200, {"status": "ok"})
        assert len(await asyncio.wait_for(pending, 30)) > 0
        assert await call(s, "GET", url + "/is_paused") == (200, {"is_paused": False})
    run(scenario, one.url)


@pytest.mark.parametrize("query", ["mode=wait", "wait_for_inflight_requests=true"])   # the latter: vLLM's earlier name
def test_pause_wait_returns_after_in_flight_requests(one, query):
    async def scenario(s, url):
        st = Stream()
        task = asyncio.create_task(stream_completion(s, url, {**GREEDY, "max_tokens": 80}, st=st))
        await until(lambda: len(st.texts) >= 2)
        t0 = time.monotonic()
        assert await call(s, "POST", url + f"/pause?{query}") == (200, {"status": "ok"})
        t1 = time.monotonic()
        await asyncio.wait_for(task, 10)
        assert st.finish == "length"  # finished, not aborted
        # /pause answered once the request was done (its last chunk may trail the reply by a hair)
        assert st.times[-1] - t1 < 0.5, (st.times[-1] - t1)
        assert t1 - t0 > 0.5 * (st.times[-1] - t0), (t1 - t0, st.times[-1] - t0)
        assert await call(s, "POST", url + "/resume") == (200, {"status": "ok"})
    run(scenario, one.url)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_pause_keep_freezes_and_resumes_exactly(one, clear_cache):
    # 400 tokens: the tiny model writes 64 in ~0.1 s, which a busy CI machine's /pause call
    # outlasted once (the request was done before the pause).
    body = {**GREEDY, "max_tokens": 400}

    async def scenario(s, url):
        ref = await complete(s, url, body)
        st = Stream()
        task = asyncio.create_task(stream_completion(s, url, body, st=st))
        await until(lambda: len(st.texts) >= 3)
        t0 = time.monotonic()
        status, _ = await call(s, "POST", url + f"/pause?mode=keep&clear_cache={str(clear_cache).lower()}")
        assert status == 200 and time.monotonic() - t0 < 2.0  # never waits on the frozen requests
        assert not st.done, "the request finished before the pause: make it longer"
        await asyncio.sleep(0.3)  # what was already on its way
        n = len(st.texts)
        await asyncio.sleep(0.5)
        assert len(st.texts) == n and not st.done, "tokens arrived while paused"
        assert await call(s, "POST", url + "/resume") == (200, {"status": "ok"})
        await asyncio.wait_for(task, 30)
        assert st.finish == "length"
        assert st.text == ref
    run(scenario, one.url)


# ======================================================================= three API servers

def test_control_endpoints_need_the_api_key(multi):
    async def scenario(s, url):
        for method, path in (("POST", "/sleep?level=0"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                             ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc")):
            async with s.request(method, url + path, json={"method": "ping"}) as r:
                assert r.status == 401, path
                assert r.headers[INDEX] in ("0", "1", "2")
        async with s.get(url + "/health") as r:
            assert r.status == 200
        assert await call(s, "GET", url + "/is_paused", AUTH) == (200, {"is_paused": False})
    run(scenario, multi.url)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_levels_keep_greedy_output(multi, level):
    body = {**GREEDY, "max_tokens": 24}

    async def memory(s, url):
        status, out = await call(s, "POST", url + "/collective_rpc", AUTH, json={"method": "memory_info"})
        assert status == 200 and len(out["results"]) == 1, out
        return out["results"][0]

    async def scenario(s, url):
        ref = await complete(s, url, body, AUTH)
        mem = await memory(s, url)
        assert mem["weights"] > 0 and mem["kv_cache"] > 0
        assert await call(s, "POST", url + f"/sleep?level={level}", AUTH) == (200, {"status": "ok"})
        assert await call(s, "GET", url + "/is_sleeping", AUTH) == (200, {"is_sleeping": True})
        mem = await memory(s, url)
        assert mem["weights"] == 0 and mem["kv_cache"] == 0, mem
        assert await call(s, "POST", url + "/wake_up", AUTH) == (200, {"status": "ok"})
        assert await call(s, "GET", url + "/is_sleeping", AUTH) == (200, {"is_sleeping": False})
        mem = await memory(s, url)
        assert mem["weights"] > 0 and mem["kv_cache"] > 0
        assert await complete(s, url, body, AUTH) == ref
    run(scenario, multi.url)


async def _indexes_seen(s, url: str, path: str, want: int = 3, timeout: float = 30.0) -> dict[str, dict]:
    """GET `path` on fresh connections until `want` different API servers have answered."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only API servers {sorted(seen)} answered"
        async with s.get(url + path, headers=AUTH) as r:
            assert r.status == 200
            seen[r.headers[INDEX]] = await r.json() if r.content_type == "application/json" else {}
    return seen


def test_many_clients_over_three_api_servers(multi):
    prompts = ["Beautiful is better than", "Hello world! How are", "The quick brown fox", "Tell me a story"]

    async def scenario(s, url):
        refs = [await complete(s, url, {"prompt": p, "temperature": 0, "max_tokens": 8}, AUTH) for p in prompts]
        streams = await asyncio.gather(*(
            stream_completion(s, url, {"prompt": prompts[i % 4], "temperature": 0, "max_tokens": 8}, AUTH)
            for i in range(200)))
        for i, st in enumerate(streams):
            assert st.done and st.finish in ("length", "stop") and st.text == refs[i % 4], (i, st.text)
        counts = {k: sum(st.index == k for st in streams) for k in ("0", "1", "2")}
        assert all(counts.values()), counts
    run(scenario, multi.url, fresh_connections=True)


def test_pause_is_seen_by_every_api_server(multi):
    async def scenario(s, url):
        assert await call(s, "POST", url + "/pause?mode=keep", AUTH) == (200, {"status": "ok"})
        try:
            seen = await _indexes_seen(s, url, "/is_paused")
            assert all(v == {"is_paused": True} for v in seen.values()), seen
        finally:
            assert await call(s, "POST", url + "/resume", AUTH) == (200, {"status": "ok"})
        seen = await _indexes_seen(s, url, "/is_paused")
        assert all(v == {"is_paused": False} for v in seen.values()), seen
    run(scenario, multi.url, fresh_connections=True)


def test_killing_one_api_server_stops_everything(multi):
    """Runs last on `multi`."""
    api_servers = [p for p in child_pids(multi.proc.pid) if not child_pids(p)]
    assert len(api_servers) == 3, api_servers
    os.kill(api_servers[1], signal.SIGKILL)
    t0 = time.monotonic()
    code = multi.wait(15)
    assert code != 0
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 10
    while (multi.descendants() or shm_entries()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multi.descendants(), "processes left behind"
    assert not shm_entries(), shm_entries()


# ======================================================================= in-process, fake engine

class _FakeLLM:
    def __init__(self, client_index: int = 0):
        from ipc.config import EngineConfig
        self.config = EngineConfig(model="fake", max_model_len=64, vocab_size=100)
        self.tokenizer = None
        self.client_index = client_index
        self.is_dead = False
        self.dead_reason = None
        self.calls: list[tuple] = []
        self.fail: Exception | None = None

    async def call_utility(self, method, *args, timeout=None):
        self.calls.append((method, *args))
        if self.fail is not None:
            raise self.fail
        return {"is_sleeping": True, "is_paused": False, "collective_rpc": ["pong"]}.get(method)


def test_fake_control_endpoints_off_by_default():
    async def scenario(s, url, llm):
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause"),
                             ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/collective_rpc"),
                             ("POST", "/reset_prefix_cache")):
            async with s.request(method, url + path) as r:
                assert r.status == 404, path
                assert r.headers[INDEX] == "2"
        assert llm.calls == []
    run_fake(_FakeLLM(client_index=2), scenario)


def test_fake_control_arguments_and_failures():
    async def scenario(s, url, llm):
        assert await call(s, "POST", url + "/sleep") == (200, {"status": "ok"})
        assert await call(s, "POST", url + "/sleep?level=0") == (200, {"status": "ok"})
        assert await call(s, "POST", url + "/wake_up?tags=weights&tags=kv_cache") == (200, {"status": "ok"})
        assert await call(s, "POST", url + "/wake_up") == (200, {"status": "ok"})
        assert await call(s, "POST", url + "/pause") == (200, {"status": "ok"})
        assert await call(s, "POST", url + "/pause?mode=wait&clear_cache=true") == (200, {"status": "ok"})
        assert await call(s, "GET", url + "/is_sleeping") == (200, {"is_sleeping": True})
        assert await call(s, "GET", url + "/is_paused") == (200, {"is_paused": False})
        assert await call(s, "POST", url + "/collective_rpc",
                          json={"method": "memory_info", "args": [], "kwargs": {}, "timeout": 5.0}) == \
            (200, {"results": ["pong"]})
        assert llm.calls == [("sleep", 1), ("sleep", 0), ("wake_up", ["weights", "kv_cache"]), ("wake_up", None),
                             ("pause", "abort", False), ("pause", "wait", True), ("is_sleeping",),
                             ("is_paused",), ("collective_rpc", "memory_info", [], {}, 5.0)]
        llm.fail = RuntimeError("ValueError: sleep levels 1 and 2 need --enable-sleep-mode")
        status, body = await call(s, "POST", url + "/sleep?level=2")
        assert status == 400 and body["error"]["message"] == "sleep levels 1 and 2 need --enable-sleep-mode"
        llm.fail = RuntimeError("WorkerError: worker 0: ValueError: method 'x' is not callable on workers")
        status, body = await call(s, "POST", url + "/collective_rpc", json={"method": "ping"})
        assert status == 400 and body["error"]["message"] == "method 'x' is not callable on workers"
        llm.fail = RuntimeError("WorkerError: worker 0: RuntimeError: CUDA error")
        status, body = await call(s, "POST", url + "/collective_rpc", json={"method": "ping"})
        assert status == 500 and "CUDA error" in body["error"]["message"], body
        assert body["error"]["type"] == "InternalServerError"
        llm.fail = RuntimeError("TypeError: an engine bug")  # only collective_rpc's TypeErrors are the caller's
        status, body = await call(s, "POST", url + "/pause")
        assert status == 500 and "an engine bug" in body["error"]["message"], body
    run_fake(_FakeLLM(), scenario, enable_control_endpoints=True)
