"""--distributed-executor-backend ray on CPU: a local Ray head on loopback (started here, shared
by the file, stopped at the end), TP=2 on gloo with the workers as Ray actors. Greedy tokens
equal HF transformers' (as the mp backend's do: tests/test_tensor_parallel.py); killing one worker
actor ends `loom serve` non-zero within a second, and nothing is left behind (processes, /dev/shm, the actors and placement group)."""
from __future__ import annotations

import json
import os
import random
import time

import pytest
import requests

ray = pytest.importorskip("ray")

from tests.conftest import Server, shm_entries  # noqa: E402
from tests.hf_oracle import hf_greedy  # noqa: E402

MAX_NEW = 8


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on loopback with 4 CPUs; servers join it through RAY_ADDRESS."""
    info = ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                    logging_level="WARNING", log_to_driver=False)
    try:
        yield info.address_info["gcs_address"]
    finally:
        ray.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in (5, 19, 11)]


def _eos_ids(model_dir: str) -> list[int]:
    """The checkpoint's EOS ids (config.json's and generation_config.json's), where Loom stops."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)


@pytest.fixture(scope="module")
def ray_server(ray_head, model_factory):
    """One `loom serve -tp 2` on the Ray head for the file: its tokens are checked first, then
    one of its actors is killed (a second TP=2 start on Ray cost ~20 s of the suite)."""
    model_dir = model_factory("llama", num_key_value_heads=1)
    before_shm = set(shm_entries())
    server = Server(model_dir, "-tp", "2", "--distributed-executor-backend", "ray", "--device", "cpu",
                    "--block-size", "4", "--max-num-seqs", "2", "--max-model-len", "128",
                    env={"RAY_ADDRESS": ray_head})
    try:
        yield server.wait_healthy(), model_dir, before_shm
    finally:
        server.stop()


def test_ray_tp2_tokens_equal_hf(ray_server):
    """Against HF directly: a second TP=2 engine on the mp backend (its gloo workers) cost ~12 s."""
    server, model_dir, _ = ray_server
    prompts = _prompts(256)
    r = requests.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": prompts, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert got == [hf_greedy(model_dir, p, MAX_NEW, _eos_ids(model_dir)) for p in prompts]


def test_killed_actor_ends_serve_nonzero_within_a_second(ray_server):
    """(After the tokens' test: it ends the file's server.) The actors and placement group go with
    `loom serve`, as at a clean shutdown."""
    server, _, before_shm = ray_server
    r = requests.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3,
                                                            "temperature": 0}, timeout=30)
    assert r.status_code == 200
    names = [n for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith("loom-worker-1-")]
    assert len(names) == 1
    actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    t0 = time.monotonic()
    ray.kill(actor, no_restart=True)
    code = server.proc.wait(10)
    elapsed = time.monotonic() - t0
    assert code != 0
    assert elapsed < 1.0, f"loom serve took {elapsed:.2f} s to exit after its actor died"
    deadline = time.monotonic() + 5
    while (server.descendants() or set(shm_entries()) - before_shm) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server.descendants(), "processes left behind"
    assert not set(shm_entries()) - before_shm, "/dev/shm entries left behind"
    while time.monotonic() < deadline and [n for n in ray.util.list_named_actors(all_namespaces=True)
                                           if n["name"].startswith("loom-worker-")]:
        time.sleep(0.1)
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True)
                if n["name"].startswith("loom-worker-")], "actors left behind"
