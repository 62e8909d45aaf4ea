"""Load and info for routers (vLLM's): GET /load (this API server's in-flight requests), GET
/server_info (the configuration), and ORCA's `endpoint-load-metrics` response header (KV-cache usage,
waiting and running requests) on generation responses, when the request asks with
`endpoint-load-metrics-format: text|json` or the server runs with --enable-orca-load-metrics (TEXT)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

from frontend.openai.protocol import APIError

ORCA_HEADER = "endpoint-load-metrics"
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"   # the request's choice: text or json
# the requests /load counts and the ORCA header goes on: the generation endpoints
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/invocations")


@dataclass
class EngineGauges:
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0


def orca_header(metrics_format: str, named_metrics: list[tuple[str, float]]) -> dict[str, str] | None:
    """vLLM's create_orca_header: `TEXT named_metrics.a=0.1, named_metrics.b=2.0` or
    `JSON {"named_metrics": {"a": 0.1, "b": 2.0}}`; None for another format."""
    fmt = metrics_format.lower()
    if fmt == "text":
        return {ORCA_HEADER: "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named_metrics)}
    if fmt == "json":
        return {ORCA_HEADER: "JSON " + json.dumps({"named_metrics": dict(named_metrics)})}
    return None


class LoadAPI:
    """The in-flight count (a middleware around the generation endpoints) and the engines' last
    gauges (a stat listener on every EngineCoreOutputs that carries scheduler stats)."""

    def __init__(self, server, enable_orca_load_metrics: bool = False):
        self.server = server
        self.enable_orca = enable_orca_load_metrics
        self.server_load = 0
        self.engines: dict[int, EngineGauges] = {}
        listeners = getattr(server.llm, "stat_listeners", None)
        if listeners is not None:
            listeners.append(self.on_outputs)

    def on_outputs(self, outs) -> None:
        s = outs.scheduler_stats
        if s is not None:
            self.engines[outs.engine_index] = EngineGauges(s.num_waiting, s.num_running, s.kv_cache_usage)

    def named_metrics(self) -> list[tuple[str, float]]:
        """vLLM's ORCA names: its gauges summed over the engines (KV usage: their mean)."""
        gauges = list(self.engines.values()) or [EngineGauges()]
        return [("kv_cache_usage_perc", float(sum(g.kv_cache_usage for g in gauges) / len(gauges))),
                ("num_requests_waiting", float(sum(g.waiting for g in gauges))),
                ("num_requests_running", float(sum(g.running for g in gauges)))]

    @web.middleware
    async def count_in_flight(self, request: web.Request, handler):
        if request.method != "POST" or request.path not in GENERATION_PATHS:
            return await handler(request)
        self.server_load += 1
        try:
            return await handler(request)   # (a stream's handler returns once its last chunk is written)
        finally:
            self.server_load -= 1

    async def add_orca_header(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: the header before the body, so streams carry it too."""
        if request.path not in GENERATION_PATHS:
            return
        fmt = request.headers.get(ORCA_FORMAT_HEADER) or ("text" if self.enable_orca else "")
        header = orca_header(fmt, self.named_metrics()) if fmt else None
        if header:
            response.headers.update(header)

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.server_load})

    async def server_info(self, request: web.Request) -> web.Response:
        """vLLM's: {"vllm_config": the configuration as text (k=v, ...) or, with ?config_format=json, an object}."""
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            raise APIError(f"config_format must be 'text' or 'json', got {fmt!r}", 400)
        config = self.server.config.to_dict()
        ready = getattr(getattr(self.server.llm, "client", None), "ready", None)
        config["num_gpu_blocks"] = getattr(ready, "num_gpu_blocks", None)
        text = ", ".join(f"{k}={v!r}" for k, v in config.items())
        return web.Response(text=json.dumps({"vllm_config": text if fmt == "text" else config}, default=str),
                            content_type="application/json")

    def routes(self) -> list[tuple[str, str, object]]:
        return [("GET", "/load", self.load), ("GET", "/server_info", self.server_info)]
