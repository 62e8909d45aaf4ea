"""Load and info for routers against a real `loom serve`: /load rises and falls with in-flight
requests, the ORCA endpoint-load-metrics header parses in its documented TEXT and JSON forms,
/server_info, vllm:cache_config_info, and the engine's KV-cache event stream from the process."""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import zmq

from engine_core.kv_cache_manager import hash_block
from tests.conftest import running_server
from tests.test_kv_events import DECODER, BlockStored


@pytest.fixture(scope="module")
def events_endpoint(tmp_path_factory) -> str:
    return f"ipc://{tmp_path_factory.mktemp('kvev')}/events"


@pytest.fixture(scope="module")
def server(model_factory, events_endpoint):
    conf = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint, "topic": "kv"}
    with running_server(model_factory("qwen3"), "--max-model-len", "256", "--block-size", "4",
                        "--kv-events-config", json.dumps(conf)) as s:
        yield s


def _parse_orca(value: str) -> dict[str, float]:
    """ORCA's native HTTP forms: `TEXT named_metrics.k=v, ...` and `JSON {"named_metrics": {...}}`."""
    kind, _, body = value.partition(" ")
    if kind == "TEXT":
        out = {}
        for item in body.split(", "):
            key, _, v = item.partition("=")
            assert key.startswith("named_metrics.")
            out[key[len("named_metrics."):]] = float(v)
        return out
    assert kind == "JSON"
    return {k: float(v) for k, v in json.loads(body)["named_metrics"].items()}


def test_load_rises_and_falls(server):
    assert requests.get(server.url + "/load", timeout=10).json() == {"server_load": 0}
    started = threading.Event()

    def stream():
        with requests.post(server.url + "/v1/completions", stream=True, timeout=60,
                           json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()
    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    assert requests.get(server.url + "/load", timeout=10).json()["server_load"] == 1
    t.join(60)
    deadline = time.monotonic() + 5
    while requests.get(server.url + "/load", timeout=10).json()["server_load"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("fmt", ["text", "json", "TEXT"])
def test_orca_header_when_asked(server, fmt):
    r = requests.post(server.url + "/v1/completions", headers={"endpoint-load-metrics-format": fmt}, timeout=60,
                      json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200
    metrics = _parse_orca(r.headers["endpoint-load-metrics"])
    assert set(metrics) == {"kv_cache_usage_perc", "num_requests_waiting", "num_requests_running"}
    assert 0.0 <= metrics["kv_cache_usage_perc"] <= 1.0 and metrics["num_requests_waiting"] >= 0


def test_no_orca_header_unless_asked(server):
    r = requests.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers
    r = requests.post(server.url + "/v1/completions", headers={"endpoint-load-metrics-format": "xml"},
                      json={"prompt": "hello", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers


def test_server_info(server):
    text = requests.get(server.url + "/server_info", timeout=10).json()["vllm_config"]
    assert "block_size=4" in text and "max_model_len=256" in text
    conf = requests.get(server.url + "/server_info?config_format=json", timeout=10).json()["vllm_config"]
    assert conf["block_size"] == 4 and conf["num_gpu_blocks"] > 0 and conf["enable_prefix_caching"] is True
    r = requests.get(server.url + "/server_info?config_format=yaml", timeout=10)
    assert r.status_code == 400 and "config_format" in r.json()["error"]["message"]


def test_cache_config_info(server):
    body = requests.get(server.url + "/metrics", timeout=10).text
    (line,) = [ln for ln in body.splitlines() if ln.startswith("vllm:cache_config_info{")]
    for label in ('block_size="4"', 'cache_dtype="auto"', 'enable_prefix_caching="True"', "num_gpu_blocks=",
                  'kv_offloading_size="None"', 'kv_offloading_backend="None"'):
        assert label in line


def test_engine_process_publishes_kv_events(server, events_endpoint):
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(events_endpoint)
        time.sleep(0.3)   # past the slow-joiner window
        prompt = list(range(40, 57))   # 17 tokens: 4 full blocks of 4
        r = requests.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200
        stored = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            stored += [e for e in DECODER.decode(payload).events if isinstance(e, BlockStored)]
        parent, hashes = None, []
        for i in range(4):
            parent = hash_block(parent, prompt[4 * i:4 * i + 4])
            hashes.append(parent)
        mine = [e for e in stored if set(e.block_hashes) & set(hashes)]
        assert [h for e in mine for h in e.block_hashes][:4] == hashes
        assert [t for e in mine for t in e.token_ids][:16] == prompt[:16]
    finally:
        ctx.destroy(linger=0)
