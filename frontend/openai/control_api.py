"""The control endpoints of an API server (--enable-control-endpoints): POST /reset_prefix_cache,
/sleep?level=, /wake_up?tags=, /pause?mode=&clear_cache=, /resume, /collective_rpc and GET
/is_sleeping, /is_paused; frontend/openai/rl_api.py has the others.

Routes come from the control operations' table (ipc/control.py), registered in one loop
(`ControlAPI.routes`); a route's handler is the method named after its path, which checks the
request and shapes the answer. The engine core owns the state they change, so every API server
answers the same. Engine-side ValueErrors are the caller's fault (400); any other failure is a 500.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from ipc.control import CONTROL_OPS, PAUSE_MODES, SLEEP_TAGS
from frontend.errors import EngineDeadError
from frontend.openai.protocol import APIError, dumps
from ipc.worker_methods import CLIENT_WORKER_METHODS, ENGINE_ONLY_WORKER_METHODS

# "ValueError: msg", or "RuntimeError: worker 0: ValueError: msg" from a worker
_FAILURE = re.compile(r"^(?:(?:WorkerError|RuntimeError): worker \d+: )?(\w+): (.*)\Z", re.DOTALL)


class CollectiveRPCRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    method: str
    args: list = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


def _json(obj: Any) -> web.Response:
    return web.Response(body=dumps(obj), content_type="application/json")


def _query_choice(request: web.Request, name: str, choices, default: str) -> str:
    value = request.query.get(name, default)
    if value not in choices:
        raise APIError(f"'{name}' must be one of {', '.join(map(str, choices))}; got {value!r}", 400, name)
    return value


def _query_bool(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise APIError(f"'{name}' must be true or false; got {value!r}", 400, name)


class ControlAPI:
    """Handlers of the control endpoints; `server` is the OpenAIServer (engine client, body parsing)."""

    def __init__(self, server):
        self.server = server
        self.llm = server.llm

    def routes(self) -> list[tuple[str, str, Any]]:
        """(method, path, handler) of every control operation's routes this server serves: with
        --enable-control-endpoints all of them; the profiler's also with --profiler-dir."""
        control = bool(self.server.options.enable_control_endpoints)
        served = {"control": control, "profiler": control or bool(getattr(self.server.config, "profiler_dir", None))}
        return [(r.method, r.path, getattr(self, r.handler))
                for op in CONTROL_OPS.values() for r in op.routes if served[r.gate]]

    async def _call(self, method: str, *args, param: str | None = None,
                    client_errors: tuple[str, ...] = ("ValueError",)):
        self.server.check_alive()
        try:
            # no timeout: pause?mode=wait answers only once the requests in flight have finished
            return await self.llm.call_utility(method, *args)
        except EngineDeadError:
            raise
        except OverflowError:  # msgpack carries 64-bit integers
            raise APIError("an integer argument is outside the 64-bit range", 400, param) from None
        except RuntimeError as e:
            m = _FAILURE.match(str(e))
            if m and m.group(1) in client_errors:
                raise APIError(m.group(2), 400, param) from None
            raise APIError(f"{method} failed in the engine: {e}", 500) from None

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = await self._call("reset_prefix_cache")
        return _json({"success": bool(ok) if ok is not None else True})

    async def sleep(self, request: web.Request) -> web.Response:
        level = int(_query_choice(request, "level", ("0", "1", "2"), "1"))
        await self._call("sleep", level, param="level")
        return _json({"status": "ok"})

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = [t for v in request.query.getall("tags", []) for t in v.split(",") if t]
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad:
            raise APIError(f"unknown tags {bad}; 'tags' must be among {', '.join(SLEEP_TAGS)}", 400, "tags")
        await self._call("wake_up", tags or None)   # (tags are checked above: an error now is the reload's)
        return _json({"status": "ok"})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return _json({"is_sleeping": bool(await self._call("is_sleeping"))})

    async def pause(self, request: web.Request) -> web.Response:
        """?mode=abort|wait|keep; or, as vLLM's earlier /pause, ?wait_for_inflight_requests=true
        (wait) or false (abort)."""
        mode = _query_choice(request, "mode", PAUSE_MODES, "abort")
        if "wait_for_inflight_requests" in request.query:
            waits = _query_bool(request, "wait_for_inflight_requests", False)
            if "mode" in request.query and (mode == "wait") != waits:
                raise APIError(f"'wait_for_inflight_requests' contradicts mode={mode}", 400,
                               "wait_for_inflight_requests")
            mode = "wait" if waits else mode
        clear_cache = _query_bool(request, "clear_cache", False)
        await self._call("pause", mode, clear_cache, param="mode")
        return _json({"status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await self._call("resume")
        return _json({"status": "ok"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": bool(await self._call("is_paused"))})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        req: CollectiveRPCRequest = await self.server.body(request, CollectiveRPCRequest)
        if req.method in ENGINE_ONLY_WORKER_METHODS:
            raise APIError(f"method {req.method!r} is not allowed through collective_rpc: "
                           f"{ENGINE_ONLY_WORKER_METHODS[req.method]}", 400, "method")
        if req.method not in CLIENT_WORKER_METHODS:
            raise APIError(f"method {req.method!r} is not callable on workers", 400, "method")
        if req.timeout is not None and not req.timeout > 0:
            raise APIError(f"'timeout' must be positive (seconds) or null; got {req.timeout}", 400, "timeout")
        results = await self._call("collective_rpc", req.method, req.args, req.kwargs, req.timeout,
                                   client_errors=("ValueError", "TypeError"))  # TypeError: bad args
        return _json({"results": results})
