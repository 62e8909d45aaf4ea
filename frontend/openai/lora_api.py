"""LoRA adapters over HTTP (vLLM's serving of --enable-lora):

    --lora-modules name=path [name=path ...]   (or '{"name": ..., "path": ..., "base_model_name": ...}')
        adapters served from the start; a request picks one with `"model": "<name>"`
    GET  /v1/models                  the base model, then each adapter with `parent` = the base model
    POST /v1/load_lora_adapter       {"lora_name", "lora_path", "load_inplace": false}
    POST /v1/unload_lora_adapter     {"lora_name"} (or "lora_int_id")

The load and unload routes are served with --enable-control-endpoints, or when
LOOM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING). A load reads and
checks the adapter on every worker first: one that does not fit (its rank above --max-lora-rank,
a module the model has no slot for, shapes of another model) is a 400 and nothing is kept. A
name already loaded is a 400 unless load_inplace, which replaces its weights (the RL trainer's
update: requests after it run the new weights). An unknown adapter name in a request is a 404 in
OpenAI's error shape, as an unknown model is.

The names live in each API server process (LoRARegistry); the engine knows adapters by
lora_int_id, which each API server draws from its own range so that two never collide.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import msgspec
from aiohttp import web

from frontend.errors import EngineDeadError
from frontend.openai.control_api import _FAILURE
from frontend.openai.protocol import APIError
from ipc import envs
from ipc.lora import LoRARequest

logger = logging.getLogger(__name__)

_ID_RANGE = 1 << 24   # lora_int_ids per API server: server i draws from (i * range, (i + 1) * range)


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str | None = None
    lora_int_id: int | None = None


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """--lora-modules' forms: name=path, or a JSON object {"name", "path", "base_model_name"?}."""
    out = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                obj = json.loads(v)
                out.append(LoRAModulePath(obj["name"], obj["path"], obj.get("base_model_name")))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {v!r} is not a JSON object with 'name' and 'path'") from None
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {v!r} is not name=path")
            out.append(LoRAModulePath(name, path))
    return out


def runtime_updates_allowed(options) -> bool:
    return bool(options.enable_control_endpoints) or envs.LOOM_ALLOW_RUNTIME_LORA_UPDATING


class LoRARegistry:
    """The adapters this API server serves, by name; the HTTP handlers of their routes."""

    def __init__(self, server):
        self.server = server
        self.llm = server.llm
        self.enabled = bool(getattr(server.config, "enable_lora", False))
        self.by_name: dict[str, LoRARequest] = {}
        self._base = (int(getattr(self.llm, "client_index", 0) or 0)) * _ID_RANGE
        self._next = 0

    def resolve(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name else None

    def _new_id(self) -> int:
        self._next += 1
        return self._base + self._next

    def routes(self) -> list[tuple[str, str, object]]:
        if not self.enabled or not runtime_updates_allowed(self.server.options):
            return []
        return [("POST", "/v1/load_lora_adapter", self.load_lora_adapter),
                ("POST", "/v1/unload_lora_adapter", self.unload_lora_adapter)]

    def model_cards(self, created: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "loom", "root": lr.lora_path,
                 "parent": lr.base_model_name or self.server.model_name, "max_model_len": self.server.config.max_model_len,
                 "permission": []}
                for name, lr in self.by_name.items()]

    async def _add(self, lora: LoRARequest, load_inplace: bool) -> None:
        """Read and check the adapter on every worker; APIError 400 when it does not fit."""
        self.server.check_alive()
        try:
            await self.llm.call_utility("add_lora", lora.lora_name, lora.lora_int_id, lora.lora_path, load_inplace)
        except EngineDeadError:
            raise
        except RuntimeError as e:
            m = _FAILURE.match(str(e))
            if m and m.group(1) in ("ValueError", "LoRAAdapterError"):
                raise APIError(m.group(2), 400, "lora_path") from None
            raise APIError(f"loading LoRA adapter {lora.lora_name!r} failed in the engine: {e}", 500) from None

    async def add_modules(self, modules: list[LoRAModulePath]) -> None:
        """The --lora-modules adapters, at start-up (a bad one stops the server with its reason)."""
        for m in modules:
            lora = LoRARequest(m.name, self._new_id(), m.path, m.base_model_name)
            try:
                await self._add(lora, False)
            except APIError as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e.message}") from None
            self.by_name[m.name] = lora

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        req: LoadLoRAAdapterRequest = await self.server.body(request, LoadLoRAAdapterRequest)
        if not req.lora_name or not req.lora_path:
            raise APIError("both 'lora_name' and 'lora_path' must be given", 400, "lora_name")
        if req.lora_name == self.server.model_name:
            raise APIError(f"'{req.lora_name}' is the base model's name", 400, "lora_name")
        known = self.by_name.get(req.lora_name)
        if known is not None and not req.load_inplace:
            raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load the "
                           "adapter in place, set 'load_inplace' to True.", 400, "lora_name")
        lora = (LoRARequest(req.lora_name, known.lora_int_id, req.lora_path, known.base_model_name) if known
                else LoRARequest(req.lora_name, self._new_id(), req.lora_path))
        await self._add(lora, known is not None)
        self.by_name[req.lora_name] = lora
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        req: UnloadLoRAAdapterRequest = await self.server.body(request, UnloadLoRAAdapterRequest)
        name = req.lora_name or next((n for n, lr in self.by_name.items() if lr.lora_int_id == req.lora_int_id), None)
        lora = self.by_name.get(name) if name else None
        if lora is None:
            raise APIError(f"The lora adapter '{req.lora_name or req.lora_int_id}' cannot be found.", 404,
                           "lora_name", "NotFoundError")
        del self.by_name[name]   # new requests no longer find it; those running finish with it
        self.server.check_alive()
        try:
            await self.llm.call_utility("remove_lora", lora.lora_int_id)
        except RuntimeError as e:
            logger.warning("unloading LoRA adapter %s: %s", name, e)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
