"""Data parallelism: several engine cores behind every API server (`--data-parallel-size`), on one
node and across two (simulated on loopback), and offline (LLM(data_parallel_size=2))."""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
import requests

from frontend.dp_router import DPRouter
from ipc.control import merge_results
from ipc.messages import EngineLoad
from ipc.sockets import free_tcp_port
from tests.conftest import Server, alive, child_pids, popen_serve, shm_entries
from tests.hf_oracle import hf_greedy

KEY = "dp-s3cret"
INDEX = "X-Loom-Server-Index"
RANK = "X-data-parallel-rank"
MAX_TOKENS = 6
# LOOM_ENGINE_STALL_S of dp_server: silence past this is a stall. The engine beats every second
# (an idle one up to 2 s apart), so 3 s leaves a second for a loaded box's scheduling.
STALL_S = 3.0


WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls sing".split()


def _prompts(n: int) -> list[str]:
    """Distinct texts (their first blocks differ, so prefix affinity does not pin them together)."""
    return [f"{i} " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 9)) for i in range(n)]


def _complete(session, url: str, prompt: str, rank: int | str | None = None, timeout: float = 60):
    headers = {RANK: str(rank)} if rank is not None else {}
    return session.post(url + "/v1/completions", headers=headers, timeout=timeout, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def _clean(text: str) -> str:
    """Random tokens of a random model are often partial UTF-8, which streaming and whole decodes
    render with different numbers of U+FFFD: compare the real characters (as tests/test_attach.py)."""
    return text.replace("\ufffd", "")


def _text(r) -> str:
    assert r.status_code == 200, r.text
    return _clean(r.json()["choices"][0]["text"])


def _metric(url: str, name: str, engine: str) -> float:
    total = 0.0
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _successes(url: str, engine: str) -> float:
    return _metric(url, "vllm:request_success_total", engine)


def _oracle(model: str, prompts: list[str]) -> list[str]:
    """The greedy texts Hugging Face generates (what DP=1 serves: tests/test_api_server.py)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    texts = [_clean(tok.decode(hf_greedy(model, tok.encode(p), MAX_TOKENS))) for p in prompts]
    assert sum(bool(t) for t in texts) > len(texts) // 2, "the oracle texts are mostly empty: a weak test"
    return texts


def _sessions_on_two_servers(url: str) -> tuple[requests.Session, requests.Session]:
    """Two keep-alive sessions answered by different API servers."""
    by_index: dict[str, requests.Session] = {}
    deadline = time.monotonic() + 30
    while len(by_index) < 2:
        assert time.monotonic() < deadline, f"only API servers {sorted(by_index)} answered"
        s = requests.Session()
        index = s.get(url + "/is_paused", timeout=10).headers[INDEX]
        if index in by_index:
            s.close()
        else:
            by_index[index] = s
    return by_index["0"], by_index["1"]


@pytest.fixture(scope="module")
def dp_tmp():
    """(the dp_server run's TMPDIR, where its ipc and metrics directories land apart from others',
    the Loom segments in /dev/shm before it started)."""
    tmp = tempfile.mkdtemp(prefix="dp")
    try:
        yield tmp, shm_entries()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def dp_server(model_factory, dp_tmp):
    """DP=2 behind two API servers; test_killing_one_engine_core_ends_serve kills it last. A stall is
    STALL_S of silence (test_health_follows_each_engines_heartbeat waits it out)."""
    model = model_factory("qwen3")
    server = Server(model, "--data-parallel-size", "2", "--api-server-count", "2", "--max-model-len", "256",
                    "--enable-control-endpoints",
                    env={"OMP_NUM_THREADS": "1", "TMPDIR": dp_tmp[0], "LOOM_ENGINE_STALL_S": str(STALL_S)})
    try:
        yield model, server.wait_healthy()
    finally:
        server.stop()


def test_both_engines_serve_and_match_the_oracle(dp_server):
    model, server = dp_server
    prompts = _prompts(24)
    expected = _oracle(model, prompts)
    before = {e: _successes(server.url, e) for e in "01"}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda p: _complete(requests, server.url, p), prompts))
    assert [_text(r) for r in got] == expected
    done = {e: _successes(server.url, e) - before[e] for e in "01"}
    assert done["0"] > 0 and done["1"] > 0, done            # both engine cores did work
    assert done["0"] + done["1"] == len(prompts), done      # totals exact through any API server
    generated = sum(_metric(server.url, "vllm:generation_tokens_total", e) for e in "01")
    assert generated >= len(prompts) * MAX_TOKENS


def test_rank_header_pins(dp_server):
    model, server = dp_server
    prompt = _prompts(1)[0]
    want = _oracle(model, [prompt])[0]
    for rank in (0, 1):
        before = {e: _successes(server.url, e) for e in "01"}
        for _ in range(3):
            assert _text(_complete(requests, server.url, prompt, rank)) == want
        after = {e: _successes(server.url, e) for e in "01"}
        assert after[str(rank)] - before[str(rank)] == 3 and after[str(1 - rank)] == before[str(1 - rank)]
    for bad in ("2", "-1", "x"):
        r = _complete(requests, server.url, prompt, bad)
        assert r.status_code == 400 and RANK in r.json()["error"]["message"], r.text
    # the header twice (raw, since HTTP clients merge a repeated header into one)
    host, port = server.url.split("//")[1].rsplit(":", 1)
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-data-parallel-rank: 0\r\nX-data-parallel-rank: 1\r\nConnection: close\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = b"".join(iter(lambda: s.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 400") and b"given 2 times" in answer, answer[:300]


def test_pause_through_one_server_resume_through_the_other(dp_server):
    model, server = dp_server
    a, b = _sessions_on_two_servers(server.url)
    prompts = _prompts(2)
    expected = _oracle(model, prompts)
    try:
        assert a.post(server.url + "/pause", timeout=10).json() == {"status": "ok"}
        assert b.get(server.url + "/is_paused", timeout=10).json() == {"is_paused": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_complete, requests, server.url, prompts[rank], rank) for rank in (0, 1)]
            time.sleep(2.0)
            assert not any(f.done() for f in held), "a paused engine ran a request"
            assert b.post(server.url + "/resume", timeout=10).json() == {"status": "ok"}
            for f, want in zip(held, expected):
                assert _text(f.result(60)) == want
        assert a.get(server.url + "/is_paused", timeout=10).json() == {"is_paused": False}
    finally:
        requests.post(server.url + "/resume", timeout=10)
        a.close()
        b.close()


def test_abort_follows_its_request(dp_server):
    """A client that goes away mid-stream: its request is aborted in the engine it ran on."""
    _, server = dp_server
    scheduled = lambda: _metric(server.url, "vllm:iteration_tokens_total_sum", "1")   # engine-side count
    before = scheduled()
    with requests.post(server.url + "/v1/completions", headers={RANK: "1"}, stream=True, timeout=60, json={
            "prompt": "abort me", "max_tokens": 230, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith(b"data: {")
            if events == 3:
                break
    deadline = time.monotonic() + 20
    while _metric(server.url, "vllm:num_requests_running", "1") and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert _metric(server.url, "vllm:num_requests_running", "1") == 0
    assert scheduled() - before < 100, "engine 1 ran the abandoned request on"


def test_devices_per_rank(monkeypatch):
    from ipc.data_parallel import select_devices
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    select_devices(1, 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    select_devices(1, 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(RuntimeError, match="needs GPUs"):
        select_devices(1, 2)


def test_control_calls_reach_every_engine(dp_server):
    _, server = dp_server
    r = requests.post(server.url + "/collective_rpc", json={"method": "ping"}, timeout=30)
    if r.status_code == 400:   # no such worker method here: any listed one shows the same
        pytest.skip(r.text)
    assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text   # one worker per engine
    assert requests.post(server.url + "/reset_prefix_cache", timeout=10).status_code == 200
    load = requests.get(server.url + "/get_load", timeout=10).json()   # SGLang's: an entry per rank
    assert [e["dp_rank"] for e in load] == [0, 1] and all(e["num_tokens"] >= 0 for e in load), load


def _wait_health(sessions, url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = [s.get(url + "/health", timeout=5).status_code for s in sessions]
        if got == [status] * len(sessions):
            return
        assert time.monotonic() < deadline, f"/health of the two API servers: {got}, expected {status}"
        time.sleep(0.25)


def test_health_follows_each_engines_heartbeat(dp_server):
    """One engine core that stops stepping (SIGSTOP) while the other beats: /health is 503 on every
    API server within the stall time (LOOM_ENGINE_STALL_S), and 200 again once it steps.
    Meanwhile the API servers route every unpinned request to the engine that still steps: the
    stopped one's last reported load (idle) drew half of them, which then hung."""
    _, server = dp_server
    engines = [pid for pid in child_pids(server.proc.pid) if child_pids(pid)]   # those with workers
    assert len(engines) == 2
    sessions = _sessions_on_two_servers(server.url)
    _wait_health(sessions, server.url, 200, 10)
    os.kill(engines[1], signal.SIGSTOP)
    try:
        _wait_health(sessions, server.url, 503, STALL_S + 10)
        assert "stopped stepping" in sessions[0].get(server.url + "/health", timeout=5).text
        before = _successes(server.url, "0")
        for i in range(6):   # through both API servers, each with its own router
            assert _text(_complete(sessions[i % 2], server.url, f"still served {i}", timeout=20)) is not None
        assert _successes(server.url, "0") - before == 6
    finally:
        os.kill(engines[1], signal.SIGCONT)
    _wait_health(sessions, server.url, 200, 10)
    assert _text(_complete(sessions[1], server.url, "hello", 1)) is not None


def test_live_stats_line_per_engine():
    from prometheus_client import CollectorRegistry, Gauge
    from metrics.live_stats import LiveStatsLogger
    reg = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "", ("model_name", "engine"), registry=reg)
    live = LiveStatsLogger("m", registry=reg)
    running.labels("m", "0").set(3)
    running.labels("m", "1").set(5)
    lines = live.log_once().splitlines()
    assert [line.split(":")[0] for line in lines] == ["Engine 000", "Engine 001"]
    assert "Running: 3 reqs" in lines[0] and "Running: 5 reqs" in lines[1]


def _orphan_shm(before: set[str]) -> set[str]:
    """Loom segments in /dev/shm that appeared since `before` and that no process maps (left behind;
    other servers on this machine map theirs)."""
    new = shm_entries() - before
    if not new:
        return new
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(line.rsplit("/", 1)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            pass
    return new - mapped


def test_killing_one_engine_core_ends_serve(dp_server, dp_tmp):
    """Runs last on `dp_server`: SIGKILL of one engine core ends `loom serve` non-zero, /health
    says 503 meanwhile, and nothing is left (processes, /dev/shm, the run's directories)."""
    _, server = dp_server
    tmp, before = dp_tmp
    assert _text(_complete(requests, server.url, "hello", 1)) is not None
    engines = [pid for pid in child_pids(server.proc.pid) if child_pids(pid)]   # those with workers
    assert len(engines) == 2
    assert os.listdir(tmp)                                 # the ipc dir is there
    os.kill(engines[1], signal.SIGKILL)
    statuses = set()
    while server.proc.poll() is None:   # /health says 503 while the API server lingers
        try:
            statuses.add(requests.get(server.url + "/health", timeout=1).status_code)
        except requests.RequestException:
            pass
        time.sleep(0.05)
    assert 503 in statuses, statuses
    assert server.proc.wait(30) not in (0, None)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (server.descendants() or _orphan_shm(before) or os.listdir(tmp)):
        time.sleep(0.2)
    assert not server.descendants(), "processes left behind"
    assert not _orphan_shm(before), f"/dev/shm entries left: {_orphan_shm(before)}"
    assert not os.listdir(tmp), f"left behind: {os.listdir(tmp)}"


def test_killing_loom_serve_ends_every_child(model_factory):
    """SIGKILL of `loom serve` itself ends every child, and nothing is left (the launcher's socket
    directory stayed once: each engine core removed only its own dp{rank} directory)."""
    model = model_factory("qwen3")
    tmp = tempfile.mkdtemp(prefix="dp")   # the run's ipc and metrics directories land here, apart from others'
    server = Server(model, "--data-parallel-size", "2", "--api-server-count", "1", "--max-model-len", "256",
                    env={"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)})
    try:
        server.wait_healthy()
        assert _text(_complete(requests, server.url, "hello", 1)) is not None
        assert len([pid for pid in child_pids(server.proc.pid) if child_pids(pid)]) == 2   # engines with workers
        assert os.listdir(tmp)                                 # the ipc dir is there
        children = server.descendants()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (any(alive(p) for p in children) or os.listdir(tmp)):
            time.sleep(0.2)
        assert not any(alive(p) for p in children), "processes left behind"
        assert not os.listdir(tmp), f"left behind: {os.listdir(tmp)}"
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _headless_rank(model: str, rpc_port: int, key: str | None, tmpdir: str, rank: int = 1,
                   size: int = 2, capture: bool = False) -> subprocess.Popen:
    """A headless rank 1 in its own TMPDIR: the test SIGKILLs its whole process group at once (a lost
    node), so nothing of it is left to remove its socket directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmpdir}
    env.pop("LOOM_ENGINE_AUTH_KEY", None)
    return popen_serve(model, "--headless", "--data-parallel-size", str(size), "--data-parallel-start-rank", str(rank),
                       "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
                       "--data-parallel-rpc-port", str(rpc_port), "--max-model-len", "256",
                       *(["--engine-auth-key", key] if key else []), env=env,
                       **(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if capture else {}))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def test_two_nodes_on_loopback(model_factory):
    from ipc.data_parallel import register_with_head
    model = model_factory("qwen3")
    rpc_port = free_tcp_port()
    head = Server(model, "--data-parallel-size", "3", "--data-parallel-size-local", "1",
                  "--data-parallel-rpc-port", str(rpc_port), "--api-server-count", "1", "--max-model-len", "256",
                  env={"OMP_NUM_THREADS": "1", "LOOM_ENGINE_AUTH_KEY": KEY})
    remote_tmp = tempfile.mkdtemp(prefix="dp-remote-")
    remote = _headless_rank(model, rpc_port, KEY, remote_tmp, rank=1, size=3)
    other_tmp = tempfile.mkdtemp(prefix="dp-r2-")   # (not inside remote_tmp: unix socket paths are short)
    other = _headless_rank(model, rpc_port, KEY, other_tmp, rank=2, size=3)
    try:
        head.wait_healthy()
        prompts = _prompts(2)
        expected = _oracle(model, prompts)
        for rank in (0, 1):   # both engines serve, each the oracle's tokens
            assert _text(_complete(requests, head.url, prompts[rank], rank)) == expected[rank]
        assert _successes(head.url, "1") == 1
        # an engine with the wrong key (or none) is refused, and the head keeps serving
        for key in ("wrong", None):
            with pytest.raises(PermissionError):
                register_with_head(f"tcp://127.0.0.1:{rpc_port}", 1, "tcp://127.0.0.1:1", key, timeout=10)
        assert _text(_complete(requests, head.url, prompts[1], 1)) == expected[1]
        # a second rank 1 is the command line's mistake: one line and exit 2, not a traceback and 1
        dup_tmp = tempfile.mkdtemp(prefix="dp-dup-")
        try:
            dup = _headless_rank(model, rpc_port, KEY, dup_tmp, rank=1, size=3, capture=True)
            out = dup.communicate(timeout=120)[0]
            assert dup.returncode == 2 and "already registered" in out and "Traceback" not in out, out
        finally:
            _kill_group(dup)
            shutil.rmtree(dup_tmp, ignore_errors=True)
        assert _text(_complete(requests, head.url, prompts[1], 1)) == expected[1]
        # a remote rank dies: the head ends non-zero; then the other remote rank, whose head is gone,
        # ends non-zero too (it ran on, unused, and never registered with a restarted head)
        _kill_group(other)
        assert head.proc.wait(30) not in (0, None)
        assert remote.wait(30) not in (0, None)
    finally:
        _kill_group(remote)
        _kill_group(other)
        head.stop()
        shutil.rmtree(remote_tmp, ignore_errors=True)
        shutil.rmtree(other_tmp, ignore_errors=True)


def test_offline_llm_splits_requests(model_factory):
    from frontend import LLM, SamplingParams
    model = model_factory("qwen3")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 13)] for i in range(8)]
    with LLM(model, max_model_len=256, data_parallel_size=2) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
        assert llm.router.sent == [4, 4]                      # split evenly: all sent before any report
        assert len(llm.collective_rpc("get_pid")) == 2        # control reaches both engines' workers
        assert len(set(llm.collective_rpc("get_pid"))) == 2
        llm.pause()
        assert llm.is_paused()
        llm.resume()
        assert not llm.is_paused()


# ------------------------------------------------------------ routing, in-process

def test_router_least_loaded_with_unseen_requests():
    r = DPRouter(2, block_size=4)
    r.on_load(0, EngineLoad(0, 3, 0))
    assert r.pick([1, 2]) == 1                        # the idle engine
    assert r.pick([3, 4]) == 0                        # engine 1 now has one unseen (score 4 > 3)
    assert r.sent == [1, 1]
    r2 = DPRouter(2, block_size=4)
    r2.on_load(0, EngineLoad(5, 10, 0))
    assert [r2.pick([i]) for i in range(4)] == [1, 1, 1, 1]   # engine 0 has a queue
    r2.on_load(1, EngineLoad(0, 4, 4))                # the engine took them in: no longer unseen
    assert r2.score(1) == 4 and r2.score(0) == 30


def test_router_fills_free_slots_first():
    """A burst of requests between two load reports: with the engines' max_num_seqs known, the
    engine with free slots takes them until both are full (counting each as waiting would split
    the burst and queue requests on one engine while the other runs short of a full batch)."""
    r = DPRouter(2, block_size=4, max_num_seqs=256)
    r.on_load(0, EngineLoad(0, 156, 0))
    r.on_load(1, EngineLoad(0, 236, 0))
    picks = [r.pick([i]) for i in range(120)]
    assert picks.count(0) == 100 and picks.count(1) == 20          # 256 and 256: none waits
    assert [r.pick([i]) for i in range(4)].count(0) == 2         # both full: unseen ones wait, alternate
    assert r.score(0) == r.score(1) == 4 * 2 + 256
    old = DPRouter(2, block_size=4)                              # max_num_seqs unknown: vLLM's score
    old.on_load(0, EngineLoad(0, 156, 0))
    old.on_load(1, EngineLoad(0, 236, 0))
    assert [old.pick([i]) for i in range(120)].count(0) == 70    # 226 running on one, 286 on the other
    waiting = DPRouter(2, block_size=4, max_num_seqs=256)
    waiting.on_load(0, EngineLoad(10, 200, 0))                   # waiting though not full (KV cache): they count
    waiting.on_load(1, EngineLoad(0, 240, 0))
    assert waiting.score(0) == 4 * 10 + 200 and waiting.score(1) == 240


def test_router_avoids_engines_that_stopped_stepping():
    r = DPRouter(3, block_size=4)
    r.on_load(0, EngineLoad(0, 9, 0))
    r.on_load(2, EngineLoad(0, 5, 0))
    assert [r.pick([i], avoid=frozenset({1})) for i in range(3)] == [2, 2, 0]   # engine 1 (idle) is silent
    assert r.pick([7], avoid=frozenset({0, 1, 2})) == 1    # every engine silent: the usual choice


def test_router_prefix_affinity_and_pinning():
    r = DPRouter(2, block_size=4)
    shared = [9, 9, 9, 9]
    first = r.pick(shared + [1])
    assert all(r.pick(shared + [k]) == first for k in range(2, 4))   # loads close: same engine
    r.on_load(first, EngineLoad(20, 50, r.sent[first]))                # it got busy: go elsewhere
    r.on_load(1 - first, EngineLoad(0, 0, r.sent[1 - first]))
    assert r.pick(shared + [5]) == 1 - first
    assert r.pick([1, 2, 3]) in (0, 1)                                 # shorter than a block: no affinity
    assert r.pinned(1, 2) == 1 and r.sent[1] >= 2


def test_router_sends_images_to_this_nodes_engines_only():
    """A request with images (in this host's shared-memory store) goes to an engine of this node,
    however loaded, and keeps no prefix affinity to a rank on another node."""
    r = DPRouter(3, block_size=4)
    r.remote = frozenset({1, 2})
    r.on_load(0, EngineLoad(50, 200, 0))
    assert {r.pick([7, 7, 7, 7, k], local_only=True) for k in range(6)} == {0}
    assert r.pick([8, 8, 8, 8, 1]) in (1, 2)                 # text goes to the least loaded
    assert r.pick([8, 8, 8, 8, 2], local_only=True) == 0     # the same prefix with an image: still here


def test_merge_results():
    assert merge_results("is_paused", [False, True]) is True
    assert merge_results("collective_rpc", [["a"], ["b"]]) == ["a", "b"]
    assert merge_results("reset_prefix_cache", [True, False]) is False
    assert merge_results("debug_info", [{"waiting": 1}, {"waiting": 2}])["waiting"] == 3
    assert merge_results("anything", [5]) == 5


