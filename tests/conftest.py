"""Shared fixtures: tiny models, real `loom serve` processes on free ports, cleanup checks."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import signal
import subprocess
import sys
import time

# Several processes share CI's 2 cores: OpenMP worker threads spinning on each other cost 10x.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs two pytest-xdist workers side by side. Each gets its own TMPDIR (inherited by
# every process its tests start), so that the checks for a left-behind ipc socket directory see
# only this worker's; /dev/shm is shared, and shm_entries() leaves out the other worker's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import atexit
    import shutil
    import tempfile
    _tmp = os.path.join(tempfile.gettempdir(), f"loom-tests-{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}")
    os.makedirs(_tmp, exist_ok=True)
    os.environ["TMPDIR"] = _tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, _tmp, ignore_errors=True)

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU CI runs Triton kernels in the interpreter
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from ipc.sockets import free_tcp_port
from tests.tiny_models import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _ends_with_this_test_process() -> None:
    """SIGTERM when the thread that started us ends. Between fork and exec this runs only the
    prctl call (resolved before the fork): nothing that takes a lock."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def popen_serve(model_dir: str, *args: str, **popen_kwargs) -> subprocess.Popen:
    """`loom serve MODEL ARGS` in a session of its own (a test signals or counts it as a group),
    ended by SIGTERM if the test process dies: a pytest killed by a timeout runs no fixture
    teardown, and the server would outlive it. Start it from pytest's main thread."""
    return subprocess.Popen([sys.executable, "-m", "frontend.entrypoints.cli", "serve", model_dir, *args], cwd=ROOT,
                            start_new_session=True, preexec_fn=_ends_with_this_test_process, **popen_kwargs)


# Modules of a few slow tests (servers, a Ray head, TP=2 engines: 7-60 s for 1-5 tests). `make test`
# hands whole files to two pytest-xdist workers in the order below; xdist's own order (most tests
# first, turned off in the Makefile) left these for the end, one worker running them while the
# other had nothing left to do (llava, leaks, layout and the README trainer were among the last
# files: a simulation of the scheduler over a run's durations puts the two workers' ends 16 s
# apart without them here, 1 s with them).
RUN_FIRST = ("test_ray_executor.py", "test_mm_store_lifecycle.py", "test_lifecycle.py", "test_signals.py",
             "test_attach.py", "test_llava_parity.py", "test_leaks.py", "test_layout.py", "test_readme_trainer.py")


def pytest_collection_modifyitems(config, items):
    # RUN_FIRST's modules, then the others by number of tests, most first (each module's tests
    # keep their order: the sort is stable)
    per_module: dict = {}
    for item in items:
        per_module[item.path] = per_module.get(item.path, 0) + 1
    items.sort(key=lambda item: (item.path.name not in RUN_FIRST, -per_module[item.path], str(item.path)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def engine_in_process(request):
    """A module that sets `ENGINE_IN_PROCESS = True` builds its LLMs in-process (the engine core and
    its worker in the test process, LOOM_ENABLE_MULTIPROCESSING=0): for tests of outputs and
    engine semantics, not of processes, sockets or /dev/shm. Module-scoped and autouse, so it is
    set before any module-scoped LLM fixture; LLM(multiprocess=True) still gets the processes.
    LOOM_ENABLE_MULTIPROCESSING set in the environment wins (=1: these modules in processes too)."""
    if not getattr(request.module, "ENGINE_IN_PROCESS", False) or "LOOM_ENABLE_MULTIPROCESSING" in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_ENABLE_MULTIPROCESSING", "0")
        yield


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
    """The demo model, trained once per run: pytest-xdist workers share one build (~30 s)."""
    from filelock import FileLock

    from frontend.tools.demo_model import build_demo_model
    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "demo-model"
    with FileLock(f"{out}.lock"):
        if not (out / ".built").exists():
            build_demo_model(str(out))
            (out / ".built").touch()
    return str(out)


def _maker_pid(name: str) -> int | None:
    """The pid in a Loom segment's name: the ring's and the weight tensors' maker, or the
    process that made the multimodal store's run id (its pid, then 8 hex digits)."""
    m = re.match(r"loom_ring_(\d+)_|loom-tensors-(\d+)-|loom_mm_(\d+)[0-9a-f]{8}_c\d+$", name)
    return int(next(g for g in m.groups() if g)) if m else None


def own_run_id() -> str:
    """A multimodal store run id for a server a test starts: this process's pid leads it, as
    in `shm.object_store.run_id`, so that the other pytest-xdist worker's `shm_entries()` can
    tell the segments are not its own."""
    return f"{os.getpid()}{secrets.token_hex(4)}"


def _descends_from_us(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
        except (FileNotFoundError, ProcessLookupError):
            return False
    return False


def shm_entries() -> set[str]:
    """Loom's segments in /dev/shm, less those a live process that this test process did not
    start made (another pytest-xdist worker's, a developer's own `loom serve`)."""
    def foreign(name: str) -> bool:
        pid = _maker_pid(name)
        return pid is not None and os.path.exists(f"/proc/{pid}") and not _descends_from_us(pid)
    return {n for n in os.listdir("/dev/shm") if "loom" in n.lower() and not foreign(n)}


def child_pids(pid: int, trackers: bool = False) -> list[int]:
    """A process's children; multiprocessing's resource tracker only if asked for."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
    return kids if trackers else [k for k in kids if not _is_resource_tracker(k)]


def run_to_end(client, rid: str, prompt: list[int], params, eos=(), mm_items=()):
    """Send one request through an EngineCoreClient and read its outputs until it finishes:
    (its tokens, its last EngineCoreOutput)."""
    from ipc.messages import EngineCoreRequest
    client.add_request(EngineCoreRequest(rid, prompt, params, list(eos), mm_items=list(mm_items)))
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
    """An API server's tokenizer process (frontend/openai/tokenizer_proc.py), or one of its jobs."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"frontend.openai.tokenizer_proc" in f.read()
    except FileNotFoundError:
        return False


def alive(pid: int) -> bool:
    """Running, not a zombie: a zombie has exited and holds nothing (no memory, no fd, no socket).
    An orphaned one waits for init to reap it (this VM's init reaps every ~2 s, so a stopped
    `loom serve`'s resource tracker stayed listed 1-2 s after it was gone); one whose parent
    lives is caught through that parent, listed too."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
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

    from frontend.openai.api_server import serve

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
        time.sleep(0.05)   # (a stopped server is usually clean within a few tenths of a second)
    assert not (server.descendants() if server else []), "processes left behind"
    assert not shm_entries(), f"/dev/shm entries left: {shm_entries()}"
    assert loom_ipc_dirs() <= before_ipc, "ipc socket directory left behind"


class Server:
    """A real `loom serve` child process on a free port."""

    def __init__(self, model_dir: str, *args: str, env: dict | None = None):
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w") if os.environ.get("LOOM_TEST_QUIET") else None
        self.proc = popen_serve(model_dir, "--host", "127.0.0.1", "--port", str(self.port), *args,
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
            time.sleep(0.05)   # a refused connection costs nothing: poll often, every start waits less
        raise TimeoutError("loom serve did not become healthy")

    def descendants(self) -> list[int]:
        """The live processes of the server's session (alive(): zombies left out)."""
        self.proc.poll()  # reap `loom serve` once it has exited
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split() if alive(int(p))]

    def wait(self, timeout: float) -> int:
        """`loom serve`'s exit code; past the timeout, every process of the server prints its
        threads' stacks to stderr (ipc/procs.py dump_stacks_on_sigusr1: where a stop hangs), then
        TimeoutExpired."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in self.descendants():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
            raise

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(timeout)
        # whatever is left of the session is a bug, but never leave it running
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        return self.proc.returncode


@contextlib.contextmanager
def running_server(model_dir: str, *args: str, timeout: float = 180.0, env: dict | None = None):
    """A healthy `loom serve` for a module-scoped fixture (`with running_server(...) as s: yield s`),
    stopped at the end whatever happens."""
    s = Server(model_dir, *args, env=env)
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
