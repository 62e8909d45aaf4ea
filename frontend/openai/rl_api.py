"""HTTP control for RL trainers and operators: weight updates and the torch profiler.

Weight updates use SGLang's endpoints and request fields, so trainer-side clients written for
SGLang (TorchRL's, verl's, slime's) work unchanged; only with --enable-control-endpoints (and the
API key when one is set):

    POST /update_weights_from_disk        {model_path, load_format="auto", flush_cache=true, abort_all_requests=false}
    POST /init_weights_update_group       {master_address, master_port, rank_offset, world_size,
                                           group_name="weight_update_group", backend="nccl"}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache=true,
                                           abort_all_requests=false}
    POST /destroy_weights_update_group    {group_name}
    POST /update_weights_from_tensor      {named_tensors: [handle, ...], flush_cache=true, abort_all_requests=false}
    GET  /get_weights_by_name?name=...&truncate_size=100   (or POST {name, truncate_size})

Fields SGLang has and Loom does not use (weight_version, load_format of tensors, ...) are ignored,
so that SGLang clients' bodies pass. Each answers {"success": true, "message": ...}; a failure is
{"success": false, "message": ...} with OpenAI's "error" object beside it, status 400 for the
caller's fault (a wrong name, shape or dtype, nothing changed; the engine not paused) and 500
otherwise. Weight updates need the
engine paused (POST /pause?mode=keep), or abort_all_requests=true: requests in flight end with
finish_reason "abort", as in SGLang. update_weights_from_tensor never unpickles: its handles are
JSON (shared memory or CUDA IPC; format in ipc/tensor_handles.py), not SGLang's pickled
`serialized_named_tensors`, which is refused.

SGLang's generation control, which trainer clients call around an update (TorchRL's transport
does), maps onto Loom's pause (also control endpoints):

    POST /pause_generation {mode="abort"}  abort -> pause(abort); retract -> pause(keep, clear_cache:
                                           running requests give back their KV and recompute);
                                           in_place -> pause(keep)
    POST /continue_generation              resume()
    POST /flush_cache                      reset the prefix cache
    GET  /get_load                         [{"dp_rank", "num_reqs", "num_waiting_reqs", "num_running_reqs",
                                             "num_tokens" (KV-cache tokens in use: blocks x block size)}]

The profiler (POST /start_profile, POST /stop_profile; optional `profile_prefix` in a JSON body
or the query) is served when --profiler-dir (or LOOM_TORCH_PROFILER_DIR) is set or the control
endpoints are enabled.

Which routes exist, and when each is served, is declared in ipc/control.py; `control_routes` registers them.
"""
from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from frontend.openai.control_api import ControlAPI
from frontend.openai.protocol import APIError, dumps, parse_request

DEFAULT_GROUP = "weight_update_group"


class UpdateWeightFromDiskReqInput(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitWeightsUpdateGroupReqInput(msgspec.Struct, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(msgspec.Struct, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False


class DestroyWeightsUpdateGroupReqInput(msgspec.Struct, kw_only=True):
    group_name: str = DEFAULT_GROUP


class UpdateWeightsFromTensorReqInput(msgspec.Struct, kw_only=True):
    named_tensors: list[dict[str, Any]] | None = None
    serialized_named_tensors: Any = None   # SGLang's pickles: refused
    flush_cache: bool = True
    abort_all_requests: bool = False


class GetWeightsByNameReqInput(msgspec.Struct, kw_only=True):
    name: str
    truncate_size: int = 100


class PauseGenerationReqInput(msgspec.Struct, kw_only=True):
    mode: str = "abort"


_PAUSE_MODES = {"abort": ("abort", False), "retract": ("keep", True), "in_place": ("keep", False)}


class ProfileReqInput(msgspec.Struct, kw_only=True):
    profile_prefix: str | None = None


def _result(success: bool, message: str, status: int = 200, error: APIError | None = None) -> web.Response:
    body: dict = {"success": success, "message": message}
    if error is not None:
        body.update(error.body())
    return web.Response(body=dumps(body), status=status, content_type="application/json")


class RLControl(ControlAPI):
    """Handlers of the endpoints above; engine calls, their error mapping and the routes are ControlAPI's."""

    async def _body(self, request: web.Request, cls, optional: bool = False):
        raw = await self.server.body(request)
        if optional and not raw.strip():
            return cls()
        return parse_request(raw, cls)

    async def _update(self, method: str, *args, abort_all_requests: bool = False) -> web.Response:
        """Run a weight update; with abort_all_requests on an unpaused engine, abort everything
        in flight, update and resume (SGLang's semantics)."""
        control = self._call
        pause = abort_all_requests and not await control("is_paused")
        try:
            if pause:
                await control("pause", "abort", False)
            n = await control(method, *args)
        except APIError as e:
            return _result(False, e.message, e.status, e)
        finally:
            if pause:
                await control("resume")
        return _result(True, f"Succeeded to update model weights ({n} tensors).")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req = await self._body(request, UpdateWeightFromDiskReqInput)
        return await self._update("update_weights_from_disk", req.model_path, req.load_format or "auto",
                                  req.flush_cache, abort_all_requests=req.abort_all_requests)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = await self._body(request, UpdateWeightsFromDistributedReqInput)
        return await self._update("update_weights_from_distributed", req.names, req.dtypes, req.shapes,
                                  req.group_name, req.flush_cache, abort_all_requests=req.abort_all_requests)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        req = await self._body(request, UpdateWeightsFromTensorReqInput)
        if req.serialized_named_tensors is not None:
            raise APIError("pickled 'serialized_named_tensors' are not accepted (unpickling runs code): send "
                           "'named_tensors', a list of JSON tensor handles (see ipc/tensor_handles.py)",
                           400, "serialized_named_tensors")
        if req.named_tensors is None:
            raise APIError("'named_tensors' is a required field", 400, "named_tensors")
        return await self._update("update_weights_from_tensor", req.named_tensors, req.flush_cache,
                                  abort_all_requests=req.abort_all_requests)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = await self._body(request, InitWeightsUpdateGroupReqInput)
        try:
            await self._call("init_weights_update_group", req.master_address, req.master_port,
                                       req.rank_offset, req.world_size, req.group_name, req.backend)
        except APIError as e:
            return _result(False, e.message, e.status, e)
        return _result(True, f"Joined weight update group {req.group_name!r}.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        req = await self._body(request, DestroyWeightsUpdateGroupReqInput, optional=True)
        try:
            await self._call("destroy_weights_update_group", req.group_name)
        except APIError as e:
            return _result(False, e.message, e.status, e)
        return _result(True, f"Destroyed weight update group {req.group_name!r}.")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            req = await self._body(request, GetWeightsByNameReqInput)
        else:
            name = request.query.get("name")
            if not name:
                raise APIError("'name' is a required query parameter", 400, "name")
            try:
                truncate_size = int(request.query.get("truncate_size", 100))
            except ValueError:
                raise APIError("'truncate_size' must be an integer", 400, "truncate_size") from None
            req = GetWeightsByNameReqInput(name=name, truncate_size=truncate_size)
        if req.truncate_size < 0:
            raise APIError(f"truncate_size must be at least 0, got {req.truncate_size}", 400, "truncate_size")
        values = await self._call("get_weights_by_name", req.name, req.truncate_size, param="name")
        return web.Response(body=dumps(values), content_type="application/json")

    # ---- SGLang's generation control

    async def pause_generation(self, request: web.Request) -> web.Response:
        req = await self._body(request, PauseGenerationReqInput, optional=True)
        if req.mode not in _PAUSE_MODES:
            raise APIError(f"'mode' must be one of {', '.join(_PAUSE_MODES)}; got {req.mode!r}", 400, "mode")
        await self._call("pause", *_PAUSE_MODES[req.mode], param="mode")
        return web.Response(body=dumps({"status": "ok", "message": "Generation paused successfully."}),
                            content_type="application/json")

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call("resume")
        return web.Response(body=dumps({"status": "ok", "message": "Generation continued successfully."}),
                            content_type="application/json")

    async def flush_cache(self, request: web.Request) -> web.Response:
        if await self._call("reset_prefix_cache"):
            return _result(True, "Cache flushed.")
        msg = "The prefix cache was not flushed: requests are running (pause first)."
        return _result(False, msg, 400, APIError(msg, 400))

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's: one entry per data-parallel rank."""
        info = await self._call("debug_info")
        block_size = self.server.config.block_size
        return web.Response(body=dumps([{
            "dp_rank": rank, "num_reqs": e["running"] + e["waiting"], "num_waiting_reqs": e["waiting"],
            "num_running_reqs": e["running"], "num_tokens": (e["num_blocks"] - e["free_blocks"]) * block_size}
            for rank, e in enumerate(info.get("engines", [info]))]), content_type="application/json")

    # ---- profiler

    async def start_profile(self, request: web.Request) -> web.Response:
        req = await self._body(request, ProfileReqInput, optional=True)
        prefix = req.profile_prefix or request.query.get("profile_prefix")
        names = await self._call("start_profile", prefix, param="profile_prefix")
        return web.Response(body=dumps({"status": "ok", "traces": names}), content_type="application/json")

    async def stop_profile(self, request: web.Request) -> web.Response:
        names = await self._call("stop_profile")
        return web.Response(body=dumps({"status": "ok", "traces": names}), content_type="application/json")


def control_routes(server) -> list[tuple[str, str, Any]]:
    """(method, path, handler) of every control endpoint this server exposes (ipc/control.py)."""
    return RLControl(server).routes()
