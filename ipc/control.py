"""The control operations, declared once: what a client may ask of the engine core besides
generating text (sleep, pause, weight updates, the profiler, ...).

CONTROL_OPS below has one row per operation, and the rest is built from it:
  - the engine core's dispatch (`EngineCore.control_call`): the calls clients may make, whether steps
    in flight are taken first, whether the engine must be paused; then the engine method of the
    operation's name runs;
  - the HTTP routes (frontend/openai/control_api.py registers them in one loop; a route's handler
    is the API's method named after its path: it checks the request and shapes the answer);
  - the offline `LLM`'s control methods (one each, all through `LLM._control`) and the API
    servers' calls (`AsyncLLM.call_utility`): every data-parallel engine answers, and
    `merge_results` makes one answer of theirs;
  - the worker methods that only the engine may call (ipc/worker_methods.py).
tests/test_control_table.py fails when a row is not wired everywhere.

A light module (no torch): every process imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

SLEEP_TAGS = ("weights", "kv_cache", "scheduling")
PAUSE_MODES = ("abort", "wait", "keep")

Merge = Callable[[list], Any]


# ------------------------------------------------------------ merges of several answers into one
# `ranks`: the workers' answers (by tensor-parallel rank) into the engine's answer;
# `engines`: the data-parallel engines' answers into the client's (one engine: its answer as is).

def first(answers: list) -> Any:
    """Rank 0's: every rank did the same (a weight update's tensor count)."""
    return answers[0]


def by_rank(answers: list) -> list:
    """Every answer, rank by rank (trace file names, collective_rpc's results)."""
    return list(answers)


def same(answers: list) -> Any:
    """The answer, when every engine gave the same; else each engine's."""
    return answers[0] if all(a == answers[0] for a in answers) else answers


def any_true(answers: list) -> bool:
    """Asleep / paused while any engine is."""
    return any(bool(a) for a in answers)


def all_ok(answers: list) -> bool:
    """Done only if every engine did it."""
    return all(a is None or bool(a) for a in answers)


def concat(answers: list) -> list:
    """Every worker's answer, engine by engine, rank by rank."""
    return [x for a in answers for x in a]


def summed(answers: list) -> dict:
    """Counts summed over the engines, and each engine's under "engines"."""
    total = {k: sum(a[k] for a in answers) for k in answers[0] if isinstance(answers[0][k], (int, float))}
    return {**total, "engines": answers}


def merge_weight_rows(parts: list[dict]) -> list:
    """The first rows of a whole weight from the ranks' parts (get_weights_by_name; each part is
    at most truncate_size rows): parts split along dim 0 are stacked (the caller cuts the rows to
    truncate_size), along dim 1 joined row by row; ranks holding the same part (a replicated KV
    head) count once, ranks holding none (values None: an expert placed on another rank) not at all."""
    parts = [p for p in parts if p["values"] is not None]
    dim = parts[0]["dim"]
    if dim is None:
        return parts[0]["values"]
    pieces = [v for _, v in sorted({p["start"]: p["values"] for p in parts}.items())]
    if dim == 0:
        return [row for piece in pieces for row in piece]
    return [[x for piece in pieces for x in piece[i]] for i in range(len(pieces[0]))]


# ------------------------------------------------------------ the table

class Route(NamedTuple):
    """An HTTP route of an operation. Its handler is the API's method named after the path."""
    method: str                # GET or POST
    path: str
    gate: str = "control"      # served with --enable-control-endpoints; "profiler": also with --profiler-dir

    @property
    def handler(self) -> str:
        return self.path.lstrip("/")

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


def GET(path: str, gate: str = "control") -> Route:   # (the table reads as HTTP)
    return Route("GET", path, gate)


def POST(path: str, gate: str = "control") -> Route:
    return Route("POST", path, gate)


ANY_WORKER_METHOD = "*"   # collective_rpc: any worker method clients may call (ipc/worker_methods.py)


@dataclass(frozen=True)
class ControlOp:
    name: str                    # the engine core's method, the utility call, the LLM's method
    args: tuple[str, ...]        # the engine method's parameters, in the order they travel
    routes: tuple[Route, ...]    # HTTP routes whose handlers call it
    drains: bool = True          # steps in flight are taken first (the workers answer between steps)
    needs_pause: bool = False    # refused while requests step: pause (keep, or abort / wait once drained) or sleep
    workers: str | None = None   # the @remote worker method it runs on every worker
    engine_only: bool = False    # that method changes state the engine tracks: not for collective_rpc
    ranks: Merge | None = None   # the workers' answers into the engine's
    engines: Merge = same        # the data-parallel engines' answers into one
    offline: bool = True         # the offline LLM has a method of this name


# a weight update: only while nothing steps, through the engine (which resets the prefix cache
# after it), answered with the number of tensors loaded (the same on every rank)
_UPDATE = dict(needs_pause=True, engine_only=True, ranks=first)

CONTROL_OPS: dict[str, ControlOp] = {op.name: op for op in (
    # reads of state the engine core owns (engine_core/control.py) answer at once (drains=False)
    ControlOp("ping", (), (), drains=False, offline=False),   # attached clients' liveness check
    ControlOp("debug_info", (), (GET("/get_load"),), engines=summed),   # counts (leak tests, SGLang's load)
    ControlOp("reset_prefix_cache", (), (POST("/reset_prefix_cache"), POST("/flush_cache")), engines=all_ok),
    # sleep and pause (the engine tracks what sleeps: its workers' sleep and wake_up are its alone)
    ControlOp("sleep", ("level",), (POST("/sleep"),), workers="sleep", engine_only=True, ranks=first),
    ControlOp("wake_up", ("tags",), (POST("/wake_up"),), workers="wake_up", engine_only=True, ranks=first),
    ControlOp("is_sleeping", (), (GET("/is_sleeping"),), drains=False, engines=any_true),
    ControlOp("pause", ("mode", "clear_cache"), (POST("/pause"), POST("/pause_generation"))),
    ControlOp("resume", (), (POST("/resume"), POST("/continue_generation"))),
    ControlOp("is_paused", (), (GET("/is_paused"),), drains=False, engines=any_true),
    ControlOp("collective_rpc", ("method", "args", "kwargs", "timeout"), (POST("/collective_rpc"),),
              workers=ANY_WORKER_METHOD, ranks=by_rank, engines=concat),
    # weight updates (RL trainers; SGLang's names): frontend/openai/rl_api.py, workers/weight_update.py
    ControlOp("update_weights_from_disk", ("model_path", "load_format", "flush_cache"),
              (POST("/update_weights_from_disk"),), workers="update_weights_from_disk", **_UPDATE),
    ControlOp("update_weights_from_tensor", ("named_tensors", "flush_cache"),
              (POST("/update_weights_from_tensor"),), workers="update_weights_from_tensor", **_UPDATE),
    ControlOp("update_weights_from_distributed", ("names", "dtypes", "shapes", "group_name", "flush_cache"),
              (POST("/update_weights_from_distributed"),), workers="update_weights_from_distributed", **_UPDATE),
    # answered once every worker is in the group (the engine polls weights_update_group_ready)
    ControlOp("init_weights_update_group",
              ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
              (POST("/init_weights_update_group"),), workers="init_weights_update_group", engine_only=True,
              ranks=first),
    ControlOp("destroy_weights_update_group", ("group_name",), (POST("/destroy_weights_update_group"),),
              workers="destroy_weights_update_group", ranks=first),
    ControlOp("get_weights_by_name", ("name", "truncate_size"),
              (GET("/get_weights_by_name"), POST("/get_weights_by_name")),
              workers="get_weights_by_name", ranks=merge_weight_rows),
    # the torch profiler (workers/profiler.py): the trace names, by rank
    ControlOp("start_profile", ("profile_prefix",), (POST("/start_profile", gate="profiler"),),
              workers="start_profile", ranks=by_rank),
    ControlOp("stop_profile", (), (POST("/stop_profile", gate="profiler"),), workers="stop_profile", ranks=by_rank),
    # LoRA adapters (--enable-lora; frontend/openai/lora_api.py serves POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter, vLLM's routes, which take adapter names): read and checked on every worker
    ControlOp("add_lora", ("lora_name", "lora_int_id", "lora_path", "load_inplace"), (), workers="add_lora",
              ranks=first),
    ControlOp("remove_lora", ("lora_int_id",), (), workers="remove_lora", ranks=first),
    ControlOp("list_loras", (), (), workers="list_loras", ranks=first),
)}


def merge_results(name: str, answers: list) -> Any:
    """One answer from every data-parallel engine's answer to control call `name` (by engine
    index). With one engine it is that engine's answer, unchanged."""
    if len(answers) == 1:
        return answers[0]
    op = CONTROL_OPS.get(name)
    return (op.engines if op is not None else same)(answers)
