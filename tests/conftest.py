"""Shared fixtures: tiny models, real `loom serve` processes on free ports, cleanup checks."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

# Several processes share CI's 2 cores: OpenMP worker threads spinning on each other cost 10x.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU CI runs Triton kernels in the interpreter
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from ipc.sockets import free_tcp_port
from tests.tiny_models import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch, **overrides) -> a model dir, built once per distinct arguments."""
    cache: dict = {}

    def make(arch: str = "qwen3", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch, **overrides)
        return cache[key]
    return make


@pytest.fixture(scope="session")
def tiny_model_dir(model_factory) -> str:
    return model_factory("qwen3")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    from frontend.demo_model import build_demo_model
    out = str(tmp_path_factory.mktemp("demo"))
    build_demo_model(out)
    return out


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "loom" in n.lower()}


def child_pids(pid: int, trackers: bool = False) -> list[int]:
    """A process's children; multiprocessing's resource tracker only if asked for."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
    return kids if trackers else [k for k in kids if not _is_resource_tracker(k)]


def run_to_end(client, rid: str, prompt: list[int], params, eos=()):
    """Send one request through an EngineCoreClient and read its outputs until it finishes:
    (its tokens, its last EngineCoreOutput)."""
    from ipc.messages import EngineCoreRequest
    client.add_request(EngineCoreRequest(rid, prompt, params, list(eos)))
    tokens = []
    while True:
        outs = client.get_outputs(timeout=60)
        assert outs is not None, "no output within 60 s"
        for o in outs.outputs:
            if o.request_id == rid:
                tokens += o.new_token_ids
                if o.finish_reason:
                    return tokens, o


def is_tokenizer_process(pid: int) -> bool:
    """An API server's tokenizer process (frontend/tokenizer_proc.py), or one of its jobs."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"frontend.tokenizer_proc" in f.read()
    except FileNotFoundError:
        return False


def _is_exiting(pid: int) -> bool:
    """Killed and not yet reaped (its command line is gone first)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return not f.read()
    except FileNotFoundError:
        return True


def serve_processes(server) -> dict[str, int]:
    """pids of a `loom serve`'s API server, engine core (the child with a child, its tokenizer
    process aside) and its worker."""
    out = {}
    for pid in child_pids(server.proc.pid):
        kids = [k for k in child_pids(pid) if not is_tokenizer_process(k) and not _is_exiting(k)]
        if kids:
            out["engine"], out["worker"] = pid, kids[0]
        else:
            out["api_server"] = pid
    return out


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except FileNotFoundError:
        return True  # gone: not one of ours to count


def run_fake(llm, scenario, **serve_kw):
    """Serve `llm` (a stand-in for AsyncLLM) on a free port in a fresh event loop and
    return `await scenario(session, base_url, llm)`."""
    import asyncio

    import aiohttp

    from frontend.api_server import serve

    async def main():
        port = free_tcp_port()
        ready = asyncio.Event()
        task = asyncio.create_task(serve(llm, "127.0.0.1", port, ready=ready, **serve_kw))
        await asyncio.wait_for(ready.wait(), 10)
        try:
            async with aiohttp.ClientSession() as session:
                return await scenario(session, f"http://127.0.0.1:{port}", llm)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return asyncio.run(main())


def loom_ipc_dirs() -> set[str]:
    import tempfile
    tmp = tempfile.gettempdir()
    return {n for n in os.listdir(tmp) if n.startswith("loom-ipc-")}


def assert_clean(before_ipc: set[str], server=None) -> None:
    """Within 10 s: no process of the server left, nothing of Loom in /dev/shm, no new ipc dir."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = server.descendants() if server else []
        if not left and not shm_entries() and loom_ipc_dirs() <= before_ipc:
            return
        time.sleep(0.2)
    assert not (server.descendants() if server else []), "processes left behind"
    assert not shm_entries(), f"/dev/shm entries left: {shm_entries()}"
    assert loom_ipc_dirs() <= before_ipc, "ipc socket directory left behind"


class Server:
    """A real `loom serve` child process on a free port."""

    def __init__(self, model_dir: str, *args: str, env: dict | None = None):
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "frontend.cli", "serve", model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self.log = open(os.devnull, "w") if os.environ.get("LOOM_TEST_QUIET") else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True,
                                     env={**os.environ, **(env or {})}, stdout=self.log, stderr=self.log)

    def wait_healthy(self, timeout: float = 120.0) -> "Server":
        import requests
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"loom serve exited with code {self.proc.returncode}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError("loom serve did not become healthy")

    def descendants(self) -> list[int]:
        self.proc.poll()  # reap `loom serve` once it has exited: a zombie still counts for pgrep
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # whatever is left of the session is a bug, but never leave it running
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        return self.proc.returncode


@contextlib.contextmanager
def running_server(model_dir: str, *args: str, timeout: float = 180.0):
    """A healthy `loom serve` for a module-scoped fixture (`with running_server(...) as s: yield s`),
    stopped at the end whatever happens."""
    s = Server(model_dir, *args)
    try:
        s.wait_healthy(timeout)
        yield s
    finally:
        s.stop()


def openai_client(server: "Server", timeout: float = 60):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture
def start_server():
    """start_server(model_dir, *flags) -> a healthy Server; stopped at teardown whatever happens."""
    servers: list[Server] = []

    def start(model_dir: str, *args: str, wait: bool = True, env: dict | None = None) -> Server:
        s = Server(model_dir, *args, env=env)
        servers.append(s)
        return s.wait_healthy() if wait else s
    yield start
    for s in servers:
        s.stop()
