"""Prometheus metrics with vLLM-compatible names, collected in the API-server
processes from the per-step stats the engine core sends.

    registry.py         the per-process registry; /metrics rendering (multiprocess merge)
    multiproc.py        the launcher's private PROMETHEUS_MULTIPROC_DIR
    stat_logger.py      PrometheusStatLogger: the vllm: metrics
    request_metrics.py  RequestMetrics: one request's frontend timeline (TTFT, ITL, e2e)
    mfu.py              estimated FLOPs / bytes per step (--enable-mfu-metrics)
    http.py             HTTP request metrics (aiohttp middleware)
    live_stats.py       the periodic "Avg prompt throughput ..." log line
    attach.py           wiring into an API server's AsyncLLM

Imports here stay lazy: the launcher uses multiproc.py before prometheus_client
may be imported anywhere.
"""
