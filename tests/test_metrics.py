"""Prometheus metrics (metrics/), the stats log line and the offline progress bar.

Part 1 is in-process: the scheduler's attention counts, the MFU formula on a
tiny shape, the stats log line, the progress bar.

Part 2 runs one REAL `loom serve --api-server-count 3 --enable-mfu-metrics` and
checks, through /metrics scraped on fresh connections (so any of the three
processes may answer): every metric name and type, MFU counters against a hand
computation, exact token / request counts after a known workload (finished by
length, by a stop string, and by a client that disconnects mid-stream), equal
totals whichever process answers, and the multiprocess directory removed at
exit.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import requests
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ipc.config import EngineConfig
from engine_core.scheduler import Scheduler
from ipc.messages import EngineCoreOutputs, RequestTiming, SchedulerStats
from metrics.live_stats import LiveStatsLogger
from metrics.mfu import MfuEstimator, ModelShape
from metrics.registry import Builder
from metrics.request_metrics import RequestMetrics
from metrics.stat_logger import PrometheusStatLogger
from tests.conftest import Server
from tests.test_scheduler import cfg, fake_step, req

# ======================================================================= part 1: in-process


def test_merge_skips_a_file_another_process_is_creating(tmp_path, monkeypatch):
    # a process that has just created its file has not sized it yet: reading it must not fail
    # (an API server that started beside another crashed on this)
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from metrics.multiproc import ENV
    from metrics.registry import collect_registry
    d = MmapedDict(str(tmp_path / "counter_101.db"))
    d.write_value(mmap_key("loom_x", "loom_x_total", [], [], "x"), 3.0, 0.0)
    d.close()
    (tmp_path / "counter_102.db").touch()  # the other process, mid-creation
    monkeypatch.setenv(ENV, str(tmp_path))
    values = {s.name: s.value for fam in collect_registry().collect() for s in fam.samples}
    assert values == {"loom_x_total": 3.0}


def test_stats_line_reads_counters_and_gauges_only(tmp_path, monkeypatch):
    # the periodic stats line merges only the counter and gauge files; /metrics merges every file
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from metrics.multiproc import ENV
    from metrics.registry import collect_registry
    for name, key in (("counter_7.db", mmap_key("c", "c_total", [], [], "c")),
                      ("gauge_livesum_7.db", mmap_key("g", "g", [], [], "g")),
                      ("histogram_7.db", mmap_key("h", "h_sum", [], [], "h"))):
        d = MmapedDict(str(tmp_path / name))
        d.write_value(key, 2.0, 0.0)
        d.close()
    monkeypatch.setenv(ENV, str(tmp_path))
    names = {s.name for fam in collect_registry(("counter", "gauge")).collect() for s in fam.samples}
    assert names == {"c_total", "g"}
    assert "h_sum" in {s.name for fam in collect_registry().collect() for s in fam.samples}


def test_scheduler_counts_attention_work_of_chunks():
    s = Scheduler(cfg(max_num_batched_tokens=8, enable_prefix_caching=False), 64)
    s.add_request(req("a", list(range(1, 13)), max_tokens=2))   # 12 prompt tokens: chunks of 8 and 4
    pairs, kv = [], []
    while s.has_unfinished():
        fake_step(s)
        st = s.make_stats()
        pairs.append(st.num_attn_query_key_pairs)
        kv.append(st.num_kv_tokens_read)
    # positions 0..7 attend 1..8 keys; 8..11 attend 9..12; the decode at position 12 attends 13
    assert pairs == [sum(range(1, 9)), sum(range(9, 13)), 13]
    assert kv == [8, 12, 13]


def test_mfu_formula_on_a_tiny_shape():
    shape = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=10, dtype_bytes=2)
    # a prefill of 3 tokens: T=3, P=1+2+3=6, K=3, one sampled token
    cost = MfuEstimator(shape).step(3, 6, 3, 1)
    # per layer: QKV 2*3*8*(2+2)*4=768, O 2*3*8*8=384, MLP 3*2*3*8*16=2304, attention 4*6*2*4=192
    assert cost.flops == 2 * (768 + 384 + 2304 + 192) + 2 * 1 * 8 * 10
    # weights 2*(8*16 + 8*8 + 3*8*16) + 10*8 = 1232 elements; KV 2*2*1*4*3 = 48; embeddings 3*8 = 24
    assert cost.read_bytes == 2 * (1232 + 48 + 24)
    assert cost.write_bytes == 2 * (2 * 2 * 1 * 4 * 3)
    assert MfuEstimator(shape).step(0, 0, 0, 0).flops == 0


def _local_logger(**kw) -> tuple[PrometheusStatLogger, CollectorRegistry]:
    registry = CollectorRegistry()
    config = EngineConfig(model="m", served_model_name="served", max_model_len=64, vocab_size=100)
    return PrometheusStatLogger(config, 0, 10, builder=Builder(registry), **kw), registry


def _value(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model_name": "served", "engine": "0", **labels}) or 0.0


def test_stat_logger_and_stats_log_line():
    log, reg = _local_logger()
    live = LiveStatsLogger("served", registry=reg)
    assert live.log_once() is None   # idle: nothing
    rm = RequestMetrics(log, 5, None, arrival_time=100.0)
    rm.on_output(100.5, 1)
    rm.on_output(100.7, 1)
    log.on_outputs(EngineCoreOutputs([], 0, time.time(), SchedulerStats(
        num_running=1, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=8, prefix_cache_hits=2,
        num_scheduled_tokens=6), None, [RequestTiming("r", 0.1, 0.2, 0.3, 5, 2)]))
    line = live.log_once()
    assert "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%" in line
    assert "Avg prompt throughput: " in line and "Avg generation throughput: " in line
    rm.on_output(101.0, 2, "length")
    assert _value(reg, "vllm:prompt_tokens_total") == 5
    assert _value(reg, "vllm:generation_tokens_total") == 4
    assert _value(reg, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(reg, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _value(reg, "vllm:inter_token_latency_seconds_count") == 2
    assert _value(reg, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.5 / 3)
    assert _value(reg, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert _value(reg, "vllm:request_params_max_tokens_sum") == 64 - 5   # None: up to max_model_len
    assert _value(reg, "vllm:request_decode_time_seconds_sum") == pytest.approx(0.3)
    assert _value(reg, "vllm:iteration_tokens_total_sum") == 6
    log.on_outputs(EngineCoreOutputs([], 0, time.time(), SchedulerStats(sleep_level=1)))
    assert _value(reg, "vllm:engine_sleep_state", sleep_state="awake") == 0
    assert _value(reg, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
    assert "Avg generation throughput: 0.0" not in live.log_once()   # the last tokens
    assert "Running: 0 reqs" in live.log_once()                      # activity ended: one idle line
    assert live.log_once() is None


def test_stats_log_line_shows_image_processing_time():
    # vLLM has no metric for the multimodal processing time: the stats line shows this API server's
    from multimodal.processor import MMStats
    log, reg = _local_logger()
    mm = MMStats(processing_secs=1.0, processed_items=2)   # before the logger: not in its first line
    live = LiveStatsLogger("served", registry=reg, mm_stats=mm)
    log.on_outputs(EngineCoreOutputs([], 0, time.time(), SchedulerStats(num_running=1)))
    mm.processing_secs, mm.processed_items = 1.012, 6
    assert live.log_once().endswith(", MM processing: 4 images, avg 3.0 ms")
    assert live.log_once().endswith(", MM processing: 0 images, avg 0.0 ms")
    assert "MM processing" not in LiveStatsLogger("served", registry=reg).log_once()   # a text model


def test_observe_many_matches_observe():
    from prometheus_client import Histogram
    from metrics.stat_logger import _observe_many
    values = [0.0, 0.01, 0.0100001, 0.3, 0.3, 7.0, 1e9, 0.02]   # on a bound, just above one, past the last
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "", buckets=[0.01, 0.3, 5.0], registry=one)
    h2 = Histogram("h", "", buckets=[0.01, 0.3, 5.0], registry=many)
    for v in values:
        h1.observe(v)
    _observe_many(h2, values)
    samples = lambda reg: sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                                 for m in reg.collect() for s in m.samples if not s.name.endswith("_created"))
    assert samples(one) == samples(many)


def test_token_metrics_are_written_per_step():
    log, reg = _local_logger()
    rm = RequestMetrics(log, 5, None, arrival_time=100.0)
    rm.on_output(100.5, 1)
    rm.on_output(100.7, 3)
    assert _value(reg, "vllm:generation_tokens_total") == 0       # gathered, not written yet
    log.on_outputs(EngineCoreOutputs([], 0, time.time(), None))   # the step's outputs are done
    assert _value(reg, "vllm:generation_tokens_total") == 4
    assert _value(reg, "vllm:prompt_tokens_total") == 5
    assert _value(reg, "vllm:time_to_first_token_seconds_count") == 1
    assert _value(reg, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.2)


def test_request_metrics_prompt_counted_once():
    log, reg = _local_logger()
    RequestMetrics(log, 7, None).finish("abort")                # aborted in the queue: counted
    RequestMetrics(log, 9, None).finish("error")                # rejected by the engine: not counted
    rm = RequestMetrics(log, 3, None)
    rm.on_output(time.monotonic(), 1)
    rm.finish("abort")
    rm.finish("stop")                                            # only the first finish counts
    assert _value(reg, "vllm:prompt_tokens_total") == 10
    assert _value(reg, "vllm:request_success_total", finished_reason="abort") == 2
    assert _value(reg, "vllm:request_success_total", finished_reason="stop") == 0


def test_progress_bar_shows_speeds(capsys):
    from frontend.entrypoints.llm import _progress
    assert _progress(2, False) is None
    bar = _progress(2, True)
    bar.add_tokens(10)
    bar.update(1, 5)
    postfix = bar.bar.postfix
    bar.close()
    assert "est. speed input:" in postfix and "output:" in postfix and "toks/s" in postfix


def test_metrics_open_without_api_key_and_http_metrics():
    from tests.test_api_server import FakeLLM, run_fake

    async def scenario(s, url, llm):
        async def scrape() -> dict:
            async with s.get(url + "/metrics") as r:   # open, like /health
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
                        for f in text_string_to_metric_families(await r.text()) for smp in f.samples}
        before = await scrape()
        for path in ("/v1/models", "/v1/models", "/nowhere", "/health"):
            async with s.get(url + path) as r:
                assert r.status in (200, 401, 404)
        after = await scrape()

        def delta(handler, status):
            key = ("http_requests_total", (("handler", handler), ("method", "GET"), ("status", status)))
            return after.get(key, 0) - before.get(key, 0)
        assert delta("/v1/models", "4xx") == 2      # no key: 401
        assert delta("none", "4xx") == 1            # no route
        assert delta("/health", "2xx") == 0 and delta("/metrics", "2xx") == 0   # probes, scrapes: left out
    run_fake(FakeLLM(), scenario, api_key="sekrit")


# ======================================================================= part 2: a real server

NAMES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:engine_sleep_state": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
    "vllm:estimated_flops_per_gpu": "counter", "vllm:estimated_read_bytes_per_gpu": "counter",
    "vllm:estimated_write_bytes_per_gpu": "counter", "http_requests": "counter",
    **{n: "histogram" for n in (
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds", "vllm:iteration_tokens_total",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
        "vllm:request_params_n", "http_request_duration_seconds", "http_request_duration_highr_seconds")},
}


class Scrape:
    def __init__(self, url: str):
        r = requests.get(url + "/metrics", headers={"Connection": "close"}, timeout=10)
        r.raise_for_status()
        self.content_type = r.headers["Content-Type"]
        self.server = r.headers.get("X-Loom-Server-Index")
        self.families = {f.name: f for f in text_string_to_metric_families(r.text)}
        self.samples = {}
        for f in self.families.values():
            for s in f.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels) -> float:
        """Sum over the samples of `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-tmp")
    server = Server(tiny_model_dir, "--api-server-count", "3", "--enable-mfu-metrics", "--served-model-name",
                    "tiny", "--max-model-len", "512", "--enable-sleep-mode", "--enable-control-endpoints",
                    env={"TMPDIR": str(tmp)})
    try:
        server.wait_healthy(timeout=180)
        yield server, tmp
    finally:
        server.stop()


def _complete(url: str, **body) -> dict:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
    r = requests.post(url + "/v1/completions", json=body, headers={"Connection": "close"}, timeout=60)
    r.raise_for_status()
    return {**r.json(), "server": r.headers.get("X-Loom-Server-Index")}


def _stream(url: str, **body) -> dict:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    usage, server = None, None
    with requests.post(url + "/v1/completions", json=body, stream=True, headers={"Connection": "close"},
                       timeout=60) as r:
        r.raise_for_status()
        server = r.headers.get("X-Loom-Server-Index")
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return {"usage": usage, "server": server}


def _wait_for(url: str, cond, timeout: float = 15.0) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        s = Scrape(url)
        if cond(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def _idle(s: Scrape) -> bool:
    return s.get("vllm:num_requests_running") == 0 and s.get("vllm:num_requests_waiting") == 0


def test_names_types_and_labels(served):
    server, _ = served
    requests.get(server.url + "/v1/models", timeout=10).raise_for_status()   # HTTP series appear with use
    s = _wait_for(server.url, lambda s: "http_requests" in s.families)
    assert s.content_type.startswith("text/plain")
    for name, kind in NAMES.items():
        assert name in s.families, name
        assert s.families[name].type == kind, name
    for name, f in s.families.items():
        if name.startswith("vllm:"):
            assert all(smp.labels.get("model_name") == "tiny" and smp.labels.get("engine") == "0"
                       for smp in f.samples), name
    info = s.families["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert int(info.labels["num_gpu_blocks"]) > 0
    assert s.get("vllm:engine_sleep_state", sleep_state="awake") == 1
    assert s.get("vllm:engine_sleep_state", sleep_state="discard_all") == 0
    assert {smp.labels["finished_reason"] for smp in s.families["vllm:request_success"].samples} == {
        "stop", "length", "abort", "error"}


def test_mfu_counters_match_hand_computation(served, tiny_model_dir):
    server, _ = served
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        c = json.load(f)
    L, H, I, V = c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, k = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or H // q
    b = 4   # float32 on CPU
    before = _wait_for(server.url, _idle)
    g, flops, read, write = 5, 0, 0, 0
    for prompt in ("Hello world", "The quick brown fox"):   # < 16 tokens: no prefix-cache hits
        p = _complete(server.url, prompt=prompt, max_tokens=g)["usage"]["prompt_tokens"]
        # one step prefills positions 0..p-1, then one step per position p..p+g-2
        steps = [list(range(p))] + [[p + j] for j in range(g - 1)]
        for positions in steps:
            T = len(positions)
            pairs = sum(pos + 1 for pos in positions)        # causal: position i attends i+1 keys
            ctx = positions[-1] + 1                           # KV tokens read by the request
            flops += (L * (2 * T * H * (q + 2 * k) * d + 2 * T * q * d * H + 3 * 2 * T * H * I
                           + 2 * 2 * pairs * q * d) + 2 * 1 * H * V)
            read += b * (L * (H * (q + 2 * k) * d + q * d * H + 3 * H * I) + V * H + L * 2 * k * d * ctx + T * H)
            write += b * L * 2 * k * d * T
    names = ("vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
             "vllm:estimated_write_bytes_per_gpu_total")
    want = dict(zip(names, (flops, read, write)))

    def delta(s: Scrape) -> dict:
        return {n: s.get(n) - before.get(n) for n in names}
    after = _wait_for(server.url, lambda s: delta(s) == want)
    assert delta(after) == pytest.approx(want, rel=1e-12)


def test_exact_counts_across_api_servers(served):
    server, _ = served
    url = server.url
    before = _wait_for(url, _idle)
    prompts, gens, max_tokens, reasons, seen = [], [], [], [], set()

    def done(resp: dict, mt: int, reason: str) -> None:
        prompts.append(resp["usage"]["prompt_tokens"])
        gens.append(resp["usage"]["completion_tokens"])
        max_tokens.append(mt)
        reasons.append(reason)
        seen.add(resp["server"])

    for i, prompt in enumerate(["Beautiful is better", "Simple is better than complex.", "Readability counts"]):
        r = _complete(url, prompt=prompt, max_tokens=6 + i)
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 6 + i
        done(r, 6 + i, "length")
    for prompt in ["Hello", "Tell me a story"]:
        r = _stream(url, prompt=prompt, max_tokens=5)
        assert r["usage"]["completion_tokens"] == 5
        done(r, 5, "length")
    chat = requests.post(url + "/v1/chat/completions", headers={"Connection": "close"}, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True})
    chat.raise_for_status()
    done({**chat.json(), "server": chat.headers.get("X-Loom-Server-Index")}, 4, "length")
    # a stop string taken from the greedy output of the same prompt (the probe is a length request too)
    probe = _complete(url, prompt="The lazy dog", max_tokens=12)
    done(probe, 12, "length")
    text = probe["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), repr(text)
    r = _complete(url, prompt="The lazy dog", max_tokens=12, stop=[stop])
    assert r["choices"][0]["finish_reason"] == "stop" and 0 < r["usage"]["completion_tokens"] < 12
    done(r, 12, "stop")

    # a client that goes away mid-stream: the request is aborted
    abort_prompt = "Flat is better than nested. Sparse is better than dense."
    n_abort_prompt = requests.post(url + "/tokenize", json={"model": "tiny", "prompt": abort_prompt},
                                   timeout=10).json()["count"]
    chunks = 0
    with requests.post(url + "/v1/completions", stream=True, timeout=60, headers={"Connection": "close"},
                       json={"model": "tiny", "prompt": abort_prompt, "max_tokens": 400, "ignore_eos": True,
                             "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                chunks += 1
                if chunks == 3:
                    break
    n_requests = len(prompts) + 1
    total_prompt = sum(prompts) + n_abort_prompt

    def delta(s: Scrape, name: str, **labels) -> float:
        return s.get(name, **labels) - before.get(name, **labels)

    _wait_for(url, lambda s: _idle(s) and delta(s, "vllm:request_success_total", finished_reason="abort") == 1
              and delta(s, "vllm:request_queue_time_seconds_count") == n_requests)
    scrapes, servers = [], set()
    for _ in range(40):   # fresh connections: several API servers should answer
        scrapes.append(Scrape(url))
        servers.add(scrapes[-1].server)
        if len(scrapes) >= 6 and len(servers) >= 2:
            break
    if scrapes[0].server is not None:
        assert len(servers) >= 2, servers
    for s in scrapes:
        gen_total = delta(s, "vllm:generation_tokens_total")
        aborted_gen = gen_total - sum(gens)
        assert chunks <= aborted_gen < 400
        assert delta(s, "vllm:prompt_tokens_total") == total_prompt
        assert delta(s, "vllm:prefix_cache_queries_total") == total_prompt   # every request scheduled once
        for reason in ("length", "stop", "abort", "error"):
            want = reasons.count(reason) + (reason == "abort")
            assert delta(s, "vllm:request_success_total", finished_reason=reason) == want, reason
        for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                     "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                     "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
                     "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                     "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
            assert delta(s, name + "_count") == n_requests, name
        assert delta(s, "vllm:inter_token_latency_seconds_count") == gen_total - n_requests
        assert delta(s, "vllm:request_prompt_tokens_sum") == total_prompt
        assert delta(s, "vllm:request_generation_tokens_sum") == gen_total
        assert delta(s, "vllm:request_params_max_tokens_sum") == sum(max_tokens) + 400
        assert delta(s, "vllm:iteration_tokens_total_count") > 0
        assert delta(s, "vllm:iteration_tokens_total_sum") >= total_prompt
        assert s.get("vllm:num_requests_running") == s.get("vllm:num_requests_waiting") == 0
        assert s.get("vllm:kv_cache_usage_perc") == 0
        # 7 completed; the one whose client left counts as 2xx or 4xx (499) depending on where it noticed
        assert delta(s, "http_requests_total", handler="/v1/completions", method="POST", status="2xx") >= 7
        assert delta(s, "http_requests_total", handler="/v1/completions") <= 8
        assert delta(s, "http_requests_total", handler="/v1/chat/completions", status="2xx") == 1
        assert delta(s, "http_requests_total", handler="/metrics") == 0   # scrapes are not counted
        assert _same_totals(s, scrapes[0])


def _same_totals(a: Scrape, b: Scrape) -> bool:
    """The same vllm: values (HTTP ones may move: the abandoned stream's handler may still be ending)."""
    keys = {k for k in a.samples if k[0].startswith("vllm:")}
    return all(a.samples[k] == pytest.approx(b.samples.get(k), rel=1e-9, abs=1e-9) for k in keys)


def test_sleep_state_follows_the_engine(served):
    server, _ = served

    def state(s: Scrape) -> tuple:
        return tuple(s.get("vllm:engine_sleep_state", sleep_state=k) for k in ("awake", "weights_offloaded",
                                                                                 "discard_all"))
    requests.post(server.url + "/sleep?level=1", timeout=30).raise_for_status()
    assert state(_wait_for(server.url, lambda s: state(s) == (0, 1, 0))) == (0, 1, 0)
    requests.post(server.url + "/wake_up", timeout=30).raise_for_status()
    assert state(_wait_for(server.url, lambda s: state(s) == (1, 0, 0))) == (1, 0, 0)


def test_multiproc_dir_removed_at_exit(served):
    server, tmp = served
    dirs = [n for n in os.listdir(tmp) if n.startswith("loom-metrics-")]
    assert len(dirs) == 1 and any(f.endswith(".db") for f in os.listdir(tmp / dirs[0]))
    assert server.stop() == 0
    assert not [n for n in os.listdir(tmp) if n.startswith("loom-metrics-")]


def test_mfu_counts_active_experts():
    """A MoE layer counts the k experts each token runs (FLOPs) and the expected distinct experts
    the step's tokens touch (bytes); mlp_only_layers / decoder_sparse_step keep dense layers."""
    from metrics.mfu import expected_experts_read
    hf = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
          "num_hidden_layers": 3, "intermediate_size": 16, "vocab_size": 10, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 6, "mlp_only_layers": [1]}
    shape = ModelShape.from_hf_config(hf, 2)
    assert (shape.num_moe_layers, shape.top_k, shape.moe_intermediate_size) == (2, 2, 6)
    est = MfuEstimator(shape)
    attn = 8 * 16 + 8 * 8                     # QKV + O per layer
    dense_mlp, expert, router = 3 * 8 * 16, 3 * 8 * 6, 8 * 4
    cost = est.step(1, 1, 1, 0)
    assert cost.flops == 2 * (3 * attn + dense_mlp + 2 * (router + 2 * expert)) + 3 * 4 * 1 * 2 * 4
    # one token reads exactly its k=2 experts per MoE layer; many tokens read all 4
    assert expected_experts_read(4, 2, 1) == 2 and abs(expected_experts_read(4, 2, 50) - 4) < 1e-9
    base = 3 * attn + dense_mlp + 2 * router + 10 * 8
    assert est.weight_params_read(1) == base + 2 * 2 * expert
    assert abs(est.weight_params_read(10_000) - (base + 2 * 4 * expert)) < 1e-6
    mixtral = ModelShape.from_hf_config({**hf, "num_experts": None, "num_local_experts": 4, "mlp_only_layers": None,
                                         "moe_intermediate_size": None}, 2)
    assert (mixtral.num_moe_layers, mixtral.moe_intermediate_size) == (3, 16)
