"""--distributed-executor-backend ray on CPU: a local Ray head on loopback (started here, shared
by the file, stopped at the end), TP=2 on gloo with the workers as Ray actors. Greedy tokens
equal HF transformers' (as the mp backend's do: tests/test_tensor_parallel.py); killing one worker
actor ends `loom serve` non-zero within a second, and nothing is left behind (processes, /dev/shm, the actors and placement group)."""
from __future__ import annotations

import random
import time

import pytest

ray = pytest.importorskip("ray")

from frontend import LLM, SamplingParams  # noqa: E402
from tests.conftest import shm_entries  # noqa: E402
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


def test_ray_tp2_tokens_equal_hf(ray_head, model_factory, monkeypatch):
    """Against HF directly: a second TP=2 engine on the mp backend (its gloo workers) cost ~12 s."""
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    model_dir = model_factory("llama", num_key_value_heads=1)
    prompts = _prompts(256)
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", block_size=4,
              max_num_seqs=2, max_model_len=128, device="cpu")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        eos = llm.config.eos_token_ids
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, MAX_NEW, eos) for p in prompts]
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True)
                if n["name"].startswith("loom-worker-")], "actors left behind"


def test_killed_actor_ends_serve_nonzero_within_a_second(ray_head, model_factory, start_server):
    model_dir = model_factory("llama", num_key_value_heads=1)
    before_shm = set(shm_entries())
    server = start_server(model_dir, "-tp", "2", "--distributed-executor-backend", "ray", "--device", "cpu",
                          "--block-size", "4", "--max-model-len", "128", env={"RAY_ADDRESS": ray_head})
    import requests
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
