"""Shutdown, death detection and cleanup of real processes."""
from __future__ import annotations

import gc
import json
import os
import signal
import time

import pytest
import requests

from frontend import LLM, SamplingParams
from tests.conftest import assert_clean, child_pids, loom_ipc_dirs, shm_entries


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_and_worker(server) -> tuple[int, int]:
    """The engine core is the launcher's child that has a child of its own (its worker)."""
    for pid in child_pids(server.proc.pid):
        kids = child_pids(pid)
        if kids:
            return pid, kids[0]
    raise AssertionError("engine core process not found")


def test_idle_engine_does_not_spin_and_sigint_stops_everything(tiny_model_dir, start_server):
    """(SIGTERM of loom serve, with its drain and the same cleanup checks, is in test_signals.py.)"""
    before = loom_ipc_dirs()
    server = start_server(tiny_model_dir, "--max-model-len", "128")
    r = requests.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200
    assert len(server.descendants()) >= 4  # launcher, engine, worker, API server
    engine, worker = _engine_and_worker(server)
    time.sleep(1.0)
    c0 = _cpu_seconds(engine) + _cpu_seconds(worker)
    time.sleep(2.0)
    used = _cpu_seconds(engine) + _cpu_seconds(worker) - c0
    assert used < 0.4, f"idle engine + worker used {used:.2f} CPU-seconds in 2 s"
    assert server.stop(signal.SIGINT) == 0
    assert_clean(before, server)


@pytest.mark.parametrize("victim", ["engine", "worker"])
def test_death_is_noticed(tiny_model_dir, start_server, victim):
    before = loom_ipc_dirs()
    server = start_server(tiny_model_dir, "--max-model-len", "512")
    engine, worker = _engine_and_worker(server)
    # A long stream in flight when the process dies: it must end with an error event, not hang.
    r = requests.post(server.url + "/v1/completions", stream=True, timeout=10,
                      json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True})
    events = []
    killed_at = None
    for line in r.iter_lines():
        if not line:
            continue
        events.append(json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]")
        if len(events) == 5:
            os.kill(engine if victim == "engine" else worker, signal.SIGKILL)
            killed_at = time.monotonic()
    assert killed_at is not None
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert time.monotonic() - killed_at < 2.0
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-2] if "choices" in e) < 400
    # /health says 503 while the API server lives, and new requests fail fast
    r = requests.get(server.url + "/health", timeout=2)
    assert r.status_code == 503
    r = requests.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=2)
    assert r.status_code == 503 and "error" in r.json()
    server.proc.wait(15)
    assert server.proc.returncode not in (0, None)
    assert_clean(before, server)


def test_llm_shutdown_and_gc_cleanup(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=128)
    proc, ipc_dir = llm.engine_procs[0], llm.ipc_dir
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    del llm, out
    gc.collect()
    proc.join(15)
    assert not proc.is_alive()
    assert not os.path.exists(ipc_dir)
    assert not shm_entries()


def test_startup_validation_fails_fast(tiny_model_dir):
    # 2 blocks of 16 tokens can never hold a 128-token request: LLM() raises (`loom serve` exits 2
    # with a line that says so: tests/test_cli.py's test_a_kv_cache_too_small_exits_2_without_a_traceback)
    with pytest.raises(Exception, match="blocks"):
        LLM(tiny_model_dir, max_model_len=128, num_gpu_blocks_override=2)
