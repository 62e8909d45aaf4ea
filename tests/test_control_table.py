"""The control operations' table (ipc/control.py) is wired everywhere: a row added there but not
to the engine, the LLM or the HTTP API fails here, and so does a worker method missing from the
allow-list the API server checks (ipc/worker_methods.py). No process is started."""
from __future__ import annotations

import ast
import inspect
import os

import pytest

from engine_core.core import EngineCore
from frontend.entrypoints.llm import LLM
from frontend.openai.rl_api import RLControl
from ipc.config import EngineConfig
from ipc.control import ANY_WORKER_METHOD, CONTROL_OPS, merge_results, merge_weight_rows
from ipc.worker_methods import CLIENT_WORKER_METHODS, ENGINE_ONLY_WORKER_METHODS
from tests.conftest import ROOT
from workers.worker import Worker

NO_ROUTE = {"ping": "attached clients' liveness check (EngineCoreClient.call_utility)",
            # vLLM's LoRA routes take adapter names: frontend/openai/lora_api.py maps them to ids
            "add_lora": "POST /v1/load_lora_adapter", "remove_lora": "POST /v1/unload_lora_adapter",
            "list_loras": "GET /v1/models lists the adapters"}


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("name", sorted(CONTROL_OPS))
def test_every_operation_has_an_engine_handler_taking_its_arguments(name):
    op = CONTROL_OPS[name]
    assert op.name == name
    handler = getattr(EngineCore, name, None)
    assert callable(handler), f"EngineCore has no method {name!r} (ipc/control.py declares it)"
    assert _params(handler) == list(op.args)


@pytest.mark.parametrize("name", sorted(CONTROL_OPS))
def test_every_operation_has_an_llm_method_through_one_path(name):
    op = CONTROL_OPS[name]
    method = getattr(LLM, name, None)
    if not op.offline:
        assert method is None, f"LLM.{name} exists: declare it offline in ipc/control.py"
        return
    assert callable(method), f"LLM has no method {name!r} (ipc/control.py declares it offline)"
    assert _params(method) == list(op.args)
    assert f'self._control("{name}"' in inspect.getsource(method), f"LLM.{name} must call self._control"


@pytest.mark.parametrize("name", sorted(CONTROL_OPS))
def test_every_operation_has_routes_with_handlers(name):
    op = CONTROL_OPS[name]
    assert op.routes or name in NO_ROUTE, f"{name} has no HTTP route"
    for route in op.routes:
        assert route.method in ("GET", "POST") and route.path.startswith("/")
        assert route.gate in ("control", "profiler")
        assert inspect.iscoroutinefunction(getattr(RLControl, route.handler, None)), \
            f"no handler RLControl.{route.handler} for {route}"


def test_routes_are_unique():
    routes = [(r.method, r.path) for op in CONTROL_OPS.values() for r in op.routes]
    assert len(routes) == len(set(routes))


class _Engine:
    """What building the app needs of an AsyncLLM; nothing is called."""
    tokenizer = None
    client_index = 0
    is_dead = False
    dead_reason = None

    def __init__(self, profiler_dir: str | None = None):
        self.config = EngineConfig(model="fake", max_model_len=64, vocab_size=100, profiler_dir=profiler_dir)


def _served(app) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


@pytest.mark.parametrize("control,profiler_dir", [(False, None), (False, "/tmp/loom-traces"), (True, None)])
def test_the_server_registers_the_declared_routes(control, profiler_dir):
    from frontend.openai.api_server import build_app
    declared = {(r.method, r.path): r.gate for op in CONTROL_OPS.values() for r in op.routes}
    served = _served(build_app(_Engine(profiler_dir), enable_control_endpoints=control))
    plain = _served(build_app(_Engine()))
    expected = {k for k, gate in declared.items() if control or (gate == "profiler" and profiler_dir)}
    assert served - plain == expected
    assert not plain & set(declared)


def test_worker_allow_list_is_every_remote_method():
    remote = {n for n in dir(Worker) if getattr(getattr(Worker, n), "_loom_remote", False) is True}
    engine_only = set(ENGINE_ONLY_WORKER_METHODS) - {"shutdown"}   # (shutdown: the worker loop's, not @remote)
    assert not CLIENT_WORKER_METHODS & engine_only
    assert CLIENT_WORKER_METHODS | engine_only == remote, \
        "list each @remote Worker method in ipc/worker_methods.py (CLIENT_WORKER_METHODS or engine-only)"


@pytest.mark.parametrize("name", sorted(CONTROL_OPS))
def test_worker_methods_of_operations_are_remote(name):
    op = CONTROL_OPS[name]
    assert (op.workers is None) == (op.ranks is None), "an operation that reaches the workers merges their answers"
    assert not op.engine_only or op.workers in ENGINE_ONLY_WORKER_METHODS
    if op.workers not in (None, ANY_WORKER_METHOD):
        assert getattr(getattr(Worker, op.workers, None), "_loom_remote", False) is True


def _imports(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_the_executors_of_the_engine_core_import_workers():
    """The engine core does not import torch (tests/test_layout.py): worker code stays in workers."""
    d = os.path.join(ROOT, "engine_core")
    for name in sorted(os.listdir(d)):
        if name.endswith(".py") and name not in ("executor.py", "uniproc_executor.py", "ray_executor.py"):   # they start workers
            bad = [m for m in _imports(os.path.join(d, name)) if m == "workers" or m.startswith("workers.")]
            assert not bad, f"engine_core/{name} imports {bad}"
    for name in ("control_api.py", "rl_api.py"):   # the API server vets collective_rpc without workers.worker
        assert not [m for m in _imports(os.path.join(ROOT, "frontend", "openai", name)) if m.startswith("workers")]


def test_merges():
    assert merge_results("is_sleeping", [False, True]) is True
    assert merge_results("start_profile", [["a"], ["b"]]) == [["a"], ["b"]]   # (engines disagree: each one's)
    assert merge_results("update_weights_from_disk", [3, 3]) == 3
    # tensor parallelism: a weight split along dim 0 (stacked), dim 1 (joined row by row), or not
    parts0 = [{"dim": 0, "start": 2, "values": [[3.0], [4.0]]}, {"dim": 0, "start": 0, "values": [[1.0], [2.0]]}]
    assert merge_weight_rows(parts0) == [[1.0], [2.0], [3.0], [4.0]]
    parts1 = [{"dim": 1, "start": 0, "values": [[1.0], [3.0]]}, {"dim": 1, "start": 1, "values": [[2.0], [4.0]]},
              {"dim": 1, "start": 1, "values": [[2.0], [4.0]]}]   # (a replicated part counts once)
    assert merge_weight_rows(parts1) == [[1.0, 2.0], [3.0, 4.0]]
    assert merge_weight_rows([{"dim": None, "start": 0, "values": [5.0]}] * 2) == [5.0]
