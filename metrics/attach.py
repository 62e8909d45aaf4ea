"""Wiring metrics into an API server's AsyncLLM (called once it is ready)."""
from __future__ import annotations

from metrics.live_stats import LiveStatsLogger
from metrics.stat_logger import PrometheusStatLogger


def attach_metrics(llm, enable_mfu: bool = False, log_stats: bool | None = None) -> PrometheusStatLogger:
    """Record vLLM's metrics for `llm`: per-step stats from every EngineCoreOutputs it receives,
    per-request measurements from generate(). `log_stats` (default: client index 0, unless
    --disable-log-stats) starts the periodic stats log line; call within the running event loop."""
    config = llm.config
    ready = getattr(llm.client, "ready", None)
    stat_logger = PrometheusStatLogger(config, getattr(ready, "engine_index", 0),
                                       getattr(ready, "num_gpu_blocks", None), enable_mfu=enable_mfu)
    llm.stat_listeners.append(stat_logger.on_outputs)
    llm.stat_logger = stat_logger
    mm = getattr(llm, "mm", None)
    stat_logger.mm_stats = mm.stats if mm is not None else None
    if log_stats is None:
        log_stats = not config.disable_log_stats and llm.client_index == 0
    stat_logger.live = None
    if log_stats:
        stat_logger.live = LiveStatsLogger(config.model_name, config.log_stats_interval)
        stat_logger.live.start()
    return stat_logger
