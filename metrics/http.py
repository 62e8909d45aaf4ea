"""HTTP metrics of the API server, as prometheus-fastapi-instrumentator (which vLLM uses) names them:

    http_requests_total{method, handler, status}         status grouped: 2xx, 4xx, 5xx
    http_request_duration_seconds{method, handler}       few buckets (0.1, 0.5, 1)
    http_request_duration_highr_seconds                  many buckets, no labels

`handler` is the route template ("/v1/models/{model}"), "none" for a path no
route matches. Probes and scrapes are left out, as in vLLM: /metrics, /health,
/ping, /load, /version, /server_info. A request whose client went away before
the handler finished (the handler is cancelled) counts as status 499 (4xx).
Duration is until the handler returns: for a stream, until its end.
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from metrics.registry import Builder

EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/ping", "/load", "/version", "/server_info"})
HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30, 60)


class HttpMetrics:
    def __init__(self, builder: Builder | None = None):
        b = builder or Builder()
        self.requests = b.counter("http_requests", "Total number of requests by method, status and handler.",
                                  ("method", "status", "handler"))
        self.duration = b.histogram("http_request_duration_seconds",
                                    "Latency with only few buckets by handler. Made to be only used if "
                                    "aggregation by handler is important.", ("method", "handler"), (0.1, 0.5, 1))
        self.duration_highr = b.histogram("http_request_duration_highr_seconds",
                                          "Latency with many buckets but no API specific labels. Made for more "
                                          "accurate percentile calculations.", (), HIGHR_BUCKETS)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        resource = request.match_info.route.resource
        template = resource.canonical if resource is not None else "none"
        if template in EXCLUDED_HANDLERS:
            return await handler(request)
        start = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.requests.labels(request.method, f"{status // 100}xx", template).inc()
            self.duration.labels(request.method, template).observe(elapsed)
            self.duration_highr.observe(elapsed)
