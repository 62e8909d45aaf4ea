"""The periodic stats log line, like vLLM's:

    Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, KV cache usage: 7.8%, Prefix cache hit rate: 41.2%

One API server (client index 0) logs it every `--log-stats-interval` seconds
(off with `--disable-log-stats`). It reads the merged Prometheus values, the
same ones /metrics shows, so the numbers cover all API servers even though each
engine step's stats reach only one of them; with data parallelism, one line per
engine ("Engine 001: ..."): throughputs are the growth of
vllm:prompt_tokens / vllm:generation_tokens over the interval, the hit rate
that of the prefix-cache counters over the interval. Nothing is logged while
the engine is idle (one last line after activity ends). A multimodal model's line
ends with this API server's image processing over the interval (vLLM has no
metric for it): "MM processing: 3 images, avg 4.1 ms".
"""
from __future__ import annotations

import asyncio
import logging
import time

from metrics.registry import collect_registry

logger = logging.getLogger("loom.stats")

_COUNTERS = {"vllm:prompt_tokens_total": "prompt", "vllm:generation_tokens_total": "generation",
             "vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
             "vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv_usage"}


def snapshot(model_name: str, registry=None) -> dict[str, dict[str, float]]:
    """The values the log line needs, by engine (data-parallel rank)."""
    out: dict[str, dict[str, float]] = {}
    for family in (registry or collect_registry(("counter", "gauge"))).collect():
        for sample in family.samples:
            key = _COUNTERS.get(sample.name) or _GAUGES.get(sample.name)
            if key is None or sample.labels.get("model_name") != model_name:
                continue
            engine = out.setdefault(sample.labels.get("engine", "0"),
                                    dict.fromkeys([*_COUNTERS.values(), *_GAUGES.values()], 0.0))
            engine[key] += sample.value
    return out


def _spec_suffix(d: dict[str, float]) -> str:
    """Speculative decoding over the interval, as vLLM's SpecDecodingLogging (none without drafts):
    the mean acceptance length counts the token each verify step emits after its accepted drafts."""
    if d["drafts"] <= 0:
        return ""
    rate = 100.0 * d["accepted"] / d["draft_tokens"] if d["draft_tokens"] > 0 else 0.0
    return (f", Mean acceptance length: {1.0 + d['accepted'] / d['drafts']:.2f}, "
            f"Avg Draft acceptance rate: {rate:.1f}%")


class LiveStatsLogger:
    def __init__(self, model_name: str, interval: float = 10.0, registry=None, mm_stats=None):
        self.model_name = model_name
        self.mm_stats = mm_stats   # multimodal.processor.MMStats of this API server, if any
        self._mm_last = self._mm_now()
        self.interval = max(float(interval), 0.05)
        self.registry = registry
        self._last = snapshot(model_name, registry)
        self._last_time = time.monotonic()
        self._was_idle = True
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """In the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loom-stats-log")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.log_once()
            except Exception:  # noqa: BLE001  (logging must never take the server down)
                logger.debug("stats logging failed", exc_info=True)

    def _mm_now(self) -> tuple[int, float]:
        m = self.mm_stats
        return (m.processed_items, m.processing_secs) if m is not None else (0, 0.0)

    def _mm_suffix(self) -> str:
        """Images processed since the last line and their mean processing time."""
        (n0, s0), (n1, s1) = self._mm_last, self._mm_now()
        self._mm_last = (n1, s1)
        if self.mm_stats is None:
            return ""
        avg = 1000.0 * (s1 - s0) / (n1 - n0) if n1 > n0 else 0.0
        return f", MM processing: {n1 - n0} images, avg {avg:.1f} ms"

    def log_once(self) -> str | None:
        """Log the line for the interval since the last call, one per engine when there are several;
        returns them (None when idle)."""
        now, cur = time.monotonic(), snapshot(self.model_name, self.registry)
        dt = max(now - self._last_time, 1e-9)
        prev, self._last, self._last_time = self._last, cur, now
        zero = dict.fromkeys([*_COUNTERS.values(), *_GAUGES.values()], 0.0)
        deltas = {e: {k: c[k] - prev.get(e, zero)[k] for k in _COUNTERS.values()}
                  for e, c in cur.items()}
        idle = not any(d["prompt"] or d["generation"] or cur[e]["running"] or cur[e]["waiting"]
                       for e, d in deltas.items())
        mm = self._mm_suffix()
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        lines = []
        for e in sorted(cur, key=lambda e: (len(e), e)):
            c, d = cur[e], deltas[e]
            hit_rate = 100.0 * d["hits"] / d["queries"] if d["queries"] > 0 else 0.0
            prefix = f"Engine {int(e):03d}: " if len(cur) > 1 and e.isdigit() else ""
            lines.append(f"{prefix}Avg prompt throughput: {d['prompt'] / dt:.1f} tokens/s, "
                         f"Avg generation throughput: {d['generation'] / dt:.1f} tokens/s, "
                         f"Running: {c['running']:.0f} reqs, Waiting: {c['waiting']:.0f} reqs, "
                         f"KV cache usage: {100.0 * c['kv_usage']:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
                         + _spec_suffix(d)
                         + (mm if not lines else ""))
        for line in lines:
            logger.info("%s", line)
        return "\n".join(lines)
