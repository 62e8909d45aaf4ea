"""PrometheusStatLogger: vLLM's metrics, recorded in one API-server process.

Two sources feed it:

* every EngineCoreOutputs this API server receives (AsyncLLM.stat_listeners):
  the per-step SchedulerStats (each step's stats go to exactly one API server)
  and the engine-side RequestTiming of this server's finished requests;
* the RequestMetrics of this server's requests (metrics/request_metrics.py),
  updated by AsyncLLM as outputs arrive. Their per-token records (token
  counts, TTFT, ITL) are gathered in memory and written once per engine step
  (flush(), at the end of on_outputs) or when a request finishes: in
  multiprocess mode each counter or bucket write is a store into an mmap
  file, and one write per token cost more than detokenizing it.

Counters and histograms add up across API-server processes; gauges set from
per-step stats carry the engine's send time as their timestamp, so the
multiprocess "mostrecent" merge picks the newest engine step whichever
process recorded it.

Every vllm: metric has the labels model_name (the served model name) and
engine (the engine index); vllm:cache_config_info adds the cache settings, and
vllm:engine_sleep_state adds sleep_state = awake | weights_offloaded |
discard_all (1 for the current state, 0 for the others; Loom's sleep level 0,
which only stops scheduling, reads as awake). The engine reports a sleep change
with stats even though it does not step while asleep.

vLLM families not exported, because Loom does not do what they measure:
vllm:external_prefix_cache_* and the external_kv_transfer source of
vllm:prompt_tokens_by_source (no KV connector), vllm:mm_cache_* (text only),
vllm:kv_block_* lifetimes (vLLM samples them only with --kv-cache-metrics), and the
deprecated, hidden-by-default aliases vllm:gpu_cache_usage_perc,
vllm:gpu_prefix_cache_* and vllm:time_per_output_token_seconds (now
vllm:kv_cache_usage_perc, vllm:prefix_cache_* and vllm:inter_token_latency_seconds).
vllm:spec_decode_* are exported with --speculative-config (vLLM registers them then too);
vllm:spec_decode_num_accepted_tokens_per_pos has the label position (0 .. k - 1).
vllm:num_requests_waiting_by_reason has reason="deferred" at 0: Loom never defers a
request it has room for.

With --enable-lora, vllm:lora_requests_info (vLLM's, which routers read to route by adapter): one
series per (running_lora_adapters, waiting_lora_adapters, max_lora), the adapters' names
comma-separated, whose value is the time of the step that reported it (the newest is the state).
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from types import SimpleNamespace

from metrics.mfu import MfuEstimator, ModelShape
from metrics.registry import Builder

logger = logging.getLogger("loom.metrics")

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit")   # vLLM's external_kv_transfer: no KV connector here
WAITING_REASONS = ("capacity", "deferred")                # Loom never defers: every waiting request waits for room
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")   # sleep level 0, 1, 2

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]
_FIRST = 1e-9   # timestamp of a gauge's initial value: any real update is more recent


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def _observe_many(hist_child, values: list[float]) -> None:
    """Histogram.observe for each value, with one write per bucket touched and one to the sum:
    in multiprocess mode every write is a store into an mmap file."""
    bounds = getattr(hist_child, "_upper_bounds", None)
    if bounds is None:   # another prometheus_client layout: the public, slower way
        for v in values:
            hist_child.observe(v)
        return
    for i, n in Counter(bisect.bisect_left(bounds, v) for v in values).items():
        hist_child._buckets[i].inc(n)
    hist_child._sum.inc(sum(values))


def _set_at(gauge_child, value: float, timestamp: float) -> None:
    """Gauge.set with our own timestamp for the multiprocess "mostrecent" merge."""
    gauge_child._value.set(float(value), timestamp=timestamp)


class PrometheusStatLogger:
    def __init__(self, config, engine_index: int = 0, num_gpu_blocks: int | None = None,
                 enable_mfu: bool = False, builder: Builder | None = None):
        self.config = config
        self.model_name = config.model_name
        self.engine = str(engine_index)
        self.max_model_len = config.max_model_len or 1
        self.num_gpu_blocks = num_gpu_blocks
        self.mfu = None
        if enable_mfu:
            try:
                self.mfu = MfuEstimator(ModelShape.from_engine_config(config))
            except (OSError, KeyError, ValueError, TypeError) as e:
                logger.warning("--enable-mfu-metrics: cannot read the model's shapes (%s); no MFU metrics", e)
        b = builder or Builder()
        self.registry = b.registry
        tok = build_1_2_5_buckets(self.max_model_len)
        L = LABELS
        self._defs = SimpleNamespace(
            # gauges: the engine's state at its latest step
            running=b.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", L),
            waiting=b.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", L),
            waiting_by_reason=b.gauge("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by the "
                                      "reason they wait.", L + ("reason",)),
            kv_usage=b.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", L),
            sleep=b.gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; "
                          "awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; "
                          "discard_all = 1 means sleep level 2.", L + ("sleep_state",)),
            # counters
            prefix_queries=b.counter("vllm:prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.", L),
            prefix_hits=b.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                  L),
            preemptions=b.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", L),
            mm_queries=b.counter("vllm:mm_cache_queries",
                                 "Multi-modal cache queries, in terms of number of queried items.", L),
            mm_hits=b.counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", L),
            prompt_tokens=b.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", L),
            generation_tokens=b.counter("vllm:generation_tokens", "Number of generation tokens processed.", L),
            prompt_by_source=b.counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                       L + ("source",)),
            prompt_cached=b.counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                                    L),
            success=b.counter("vllm:request_success", "Count of successfully processed requests.",
                              L + ("finished_reason",)),
            # histograms
            iteration_tokens=b.histogram("vllm:iteration_tokens_total",
                                         "Histogram of number of tokens per engine_step.", L,
                                         ITERATION_TOKENS_BUCKETS),
            prompt_len=b.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", L, tok),
            generation_len=b.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                       L, tok),
            max_tokens=b.histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                   L, tok),
            max_generation=b.histogram("vllm:request_max_num_generation_tokens",
                                       "Histogram of maximum number of requested generation tokens.", L, tok),
            kv_computed=b.histogram("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed "
                                    "during prefill (excluding cached tokens).", L, tok),
            n=b.histogram("vllm:request_params_n", "Histogram of the n request parameter.", L, N_BUCKETS),
            ttft=b.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", L,
                             TTFT_BUCKETS),
            itl=b.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", L,
                            ITL_BUCKETS),
            tpot=b.histogram("vllm:request_time_per_output_token_seconds",
                             "Histogram of time_per_output_token_seconds per request.", L, ITL_BUCKETS),
            e2e=b.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", L,
                            REQUEST_LATENCY_BUCKETS),
            queue=b.histogram("vllm:request_queue_time_seconds",
                              "Histogram of time spent in WAITING phase for request.", L, REQUEST_LATENCY_BUCKETS),
            inference=b.histogram("vllm:request_inference_time_seconds",
                                  "Histogram of time spent in RUNNING phase for request.", L,
                                  REQUEST_LATENCY_BUCKETS),
            prefill=b.histogram("vllm:request_prefill_time_seconds",
                                "Histogram of time spent in PREFILL phase for request.", L, REQUEST_LATENCY_BUCKETS),
            decode=b.histogram("vllm:request_decode_time_seconds",
                               "Histogram of time spent in DECODE phase for request.", L, REQUEST_LATENCY_BUCKETS),
        )
        self.spec_k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        if self.spec_k:
            d = self._defs
            d.spec_drafts = b.counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", L)
            d.spec_draft_tokens = b.counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", L)
            d.spec_accepted = b.counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", L)
            d.spec_per_pos = b.counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", L + ("position",))
        if self.mfu is not None:
            d = self._defs
            d.flops = b.counter("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations "
                                "per GPU (for Model FLOPs Utilization calculations).", L)
            d.read_bytes = b.counter("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from "
                                     "memory per GPU (for Model FLOPs Utilization calculations).", L)
            d.write_bytes = b.counter("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to "
                                      "memory per GPU (for Model FLOPs Utilization calculations).", L)
        self._engines: dict[str, SimpleNamespace] = {}
        self.mm_stats = None        # multimodal.processor.MMStats of this API server, if any
        self._mm_seen = (0, 0)
        # per-token records, written by flush() once per engine step
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0
        self._generation_tokens = 0
        self._ttfts: list[float] = []
        self._itls: list[float] = []
        self._info = b.gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             ("model_name", "engine", *self._cache_info()))
        self._lora_info = (b.gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                   L + ("max_lora", "waiting_lora_adapters", "running_lora_adapters"))
                           if getattr(config, "enable_lora", False) else None)
        self._bind(self.engine)

    # ------------------------------------------------------------ series of one engine

    def _cache_info(self) -> dict[str, str]:
        c = self.config
        return {"block_size": str(c.block_size), "cache_dtype": c.kv_cache_dtype,
                "enable_prefix_caching": str(c.enable_prefix_caching),
                "gpu_memory_utilization": str(c.gpu_memory_utilization),
                "num_gpu_blocks": str(self.num_gpu_blocks), "num_gpu_blocks_override": str(c.num_gpu_blocks_override),
                "kv_cache_memory_bytes": str(c.kv_cache_memory_bytes),
                "kv_offloading_size": str(c.kv_offloading_size), "kv_offloading_backend":
                    str(c.kv_offloading_backend or ("native" if c.kv_offloading_size else None))}

    def _bind(self, engine: str) -> SimpleNamespace:
        """Children of every metric for one engine, created at 0 so that every series shows."""
        e = self._engines.get(engine)
        if e is not None:
            return e
        d, lv = self._defs, (self.model_name, engine)
        labelled = ("sleep", "success", "waiting_by_reason", "prompt_by_source", "spec_per_pos")
        e = SimpleNamespace(**{k: m.labels(*lv) for k, m in vars(d).items() if k not in labelled})
        e.sleep = {s: d.sleep.labels(*lv, s) for s in SLEEP_STATES}
        e.success = {r: d.success.labels(*lv, r) for r in FINISH_REASONS}
        e.waiting_by_reason = {r: d.waiting_by_reason.labels(*lv, r) for r in WAITING_REASONS}
        e.prompt_by_source = {r: d.prompt_by_source.labels(*lv, r) for r in PROMPT_SOURCES}
        if self.spec_k:
            e.spec_per_pos = [d.spec_per_pos.labels(*lv, str(i)) for i in range(self.spec_k)]
        for g in (e.running, e.waiting, e.kv_usage, *e.waiting_by_reason.values()):
            _set_at(g, 0, _FIRST)
        for s, g in e.sleep.items():
            _set_at(g, s == "awake", _FIRST)
        self._info.labels(model_name=self.model_name, engine=engine, **self._cache_info()).set(1)
        self._engines[engine] = e
        return e

    # ------------------------------------------------------------ per-step stats (stat_listeners)

    def on_outputs(self, outs) -> None:
        """An EngineCoreOutputs as it reached this API server."""
        # The records gathered since the last flush are of this engine's outputs (AsyncLLM calls
        # this right after processing them; everything else flushes as it records).
        engine = self.engine = str(outs.engine_index)
        e = self._bind(engine)
        s = outs.scheduler_stats
        if s is not None:
            ts = outs.timestamp or time.time()
            _set_at(e.running, s.num_running, ts)
            _set_at(e.waiting, s.num_waiting, ts)
            _set_at(e.waiting_by_reason["capacity"], s.num_waiting, ts)
            _set_at(e.kv_usage, s.kv_cache_usage, ts)
            level = min(max(s.sleep_level, 0), 2)
            for i, state in enumerate(SLEEP_STATES):
                _set_at(e.sleep[state], i == level, ts)
            counts = [(e.prefix_queries, s.prefix_cache_queries), (e.prefix_hits, s.prefix_cache_hits),
                      (e.preemptions, s.num_preemptions)]
            if self.spec_k:
                counts += [(e.spec_drafts, s.spec_num_drafts), (e.spec_draft_tokens, s.spec_num_draft_tokens),
                           (e.spec_accepted, s.spec_num_accepted_tokens)]
                counts += list(zip(e.spec_per_pos, s.spec_accepted_per_pos))
            if self.mfu is not None:
                cost = self.mfu.from_stats(s)
                counts += [(e.flops, cost.flops), (e.read_bytes, cost.read_bytes), (e.write_bytes, cost.write_bytes)]
            for counter, n in counts:
                if n:
                    counter.inc(n)
            if s.num_scheduled_tokens:
                e.iteration_tokens.observe(s.num_scheduled_tokens)
            if self._lora_info is not None:
                _set_at(self._lora_info.labels(self.model_name, engine, str(self.config.max_loras),
                                               ",".join(sorted(s.waiting_lora_adapters)),
                                               ",".join(sorted(s.running_lora_adapters))), ts, ts)
        for t in outs.finished_timings:
            e.queue.observe(max(t.queued_time, 0.0))
            e.prefill.observe(max(t.prefill_time, 0.0))
            e.decode.observe(max(t.decode_time, 0.0))
            e.inference.observe(max(t.prefill_time + t.decode_time, 0.0))
        self.flush()   # AsyncLLM calls on_outputs after it processed the step's outputs: their tokens are in

    # ------------------------------------------------------------ per-request (RequestMetrics sink)

    def use_engine(self, engine_index: int) -> None:
        """Records from now on are of this engine's requests (data parallelism: an abort's)."""
        engine = str(engine_index)
        if engine != self.engine:
            self.flush()
            self.engine = engine

    def record_prompt_tokens(self, n: int, cached: int = 0) -> None:
        self._prompt_tokens += n
        self._cached_prompt_tokens += min(cached, n)

    def record_tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        self._generation_tokens += n
        if ttft is not None:
            self._ttfts.append(max(ttft, 0.0))
        if itl is not None:
            self._itls.append(max(itl, 0.0))

    def flush(self) -> None:
        """Write the per-token records gathered since the last flush."""
        e = self._bind(self.engine)
        if self.mm_stats is not None:
            q, h = self.mm_stats.cache_queries, self.mm_stats.cache_hits
            if q > self._mm_seen[0]:
                e.mm_queries.inc(q - self._mm_seen[0])
            if h > self._mm_seen[1]:
                e.mm_hits.inc(h - self._mm_seen[1])
            self._mm_seen = (q, h)
        if self._prompt_tokens:
            cached = self._cached_prompt_tokens
            e.prompt_tokens.inc(self._prompt_tokens)
            e.prompt_by_source["local_compute"].inc(self._prompt_tokens - cached)
            if cached:
                e.prompt_by_source["local_cache_hit"].inc(cached)
                e.prompt_cached.inc(cached)
            self._prompt_tokens = self._cached_prompt_tokens = 0
        if self._generation_tokens:
            e.generation_tokens.inc(self._generation_tokens)
            self._generation_tokens = 0
        if self._ttfts:
            _observe_many(e.ttft, self._ttfts)
            self._ttfts = []
        if self._itls:
            _observe_many(e.itl, self._itls)
            self._itls = []

    def record_finished(self, rm) -> None:
        self.flush()
        e = self._bind(self.engine)
        e.success[rm.finish_reason if rm.finish_reason in e.success else "error"].inc()
        e.e2e.observe(max(rm.e2e_latency, 0.0))
        e.tpot.observe(rm.time_per_output_token)
        e.prompt_len.observe(rm.num_prompt_tokens)
        e.generation_len.observe(rm.num_generation_tokens)
        e.kv_computed.observe(max(rm.num_prompt_tokens - rm.num_cached_tokens, 0))
        if rm.is_first_choice:
            max_tokens = rm.max_tokens
            if max_tokens is None:
                max_tokens = max(self.max_model_len - rm.num_prompt_tokens, 0)
            e.max_tokens.observe(max_tokens)
            e.n.observe(rm.n)

    def record_request_done(self, max_generation_tokens: int) -> None:
        """A user request (all its n choices) is over: the most tokens any of its choices made."""
        self._bind(self.engine).max_generation.observe(max_generation_tokens)
