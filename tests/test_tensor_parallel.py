"""Tensor parallelism for real on CPU: two worker processes in one gloo group.

Greedy output at TP=2 equals HF transformers (fp32) for Llama with one KV head (replicated on
both ranks) and a vocabulary of 337 (padded to split), Qwen2 (q/k/v biases) and Qwen3 (q/k
norms); and stays the same under prefix caching, chunked prefill and preemption, for seeded
sampling too (every rank samples the same tokens).
"""
from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import requests

from frontend import LLM, SamplingParams
from ipc.config import ConfigError, EngineConfig
from tests.conftest import child_pids, loom_ipc_dirs
from tests.hf_oracle import hf_greedy
from tests.test_lifecycle import _assert_clean
from tests.test_engine_parity import check_parity

MAX_NEW = 10


def _prompts(vocab: int, lengths=(3, 17, 9, 30)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in lengths]


def test_llama_one_kv_head_uneven_vocab_matches_hf(model_factory):
    model_dir = model_factory("llama", num_key_value_heads=1, vocab_size=337)
    llm = check_parity(model_dir, _prompts(337), tensor_parallel_size=2, block_size=4, max_num_seqs=2,
                       max_model_len=128)
    assert llm.config.vocab_size == 337


def test_qwen2_biases_match_hf(model_factory):
    check_parity(model_factory("qwen2"), _prompts(300), tensor_parallel_size=2, block_size=4, max_num_seqs=2,
                 max_model_len=128)


def _workload(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(3, vocab - 16) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, vocab - 16) for _ in range(k)] for k in (1, 5, 11)]
    return prompts + [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in (2, 19, 33)]


def _generate(model_dir, prompts, params, **options):
    llm = LLM(model_dir, max_model_len=64, block_size=4, **options)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats
    finally:
        llm.shutdown()


def test_qwen3_under_prefix_caching_chunking_and_preemption(model_factory):
    """One TP=2 engine with every schedule at once: a shared prefix (prefix hits), a step budget
    of 8 tokens (every prompt chunked) and a KV cache of 20 blocks (preemptions). Greedy rows
    equal HF; seeded rows equal an ample TP=1 run."""
    model_dir = model_factory("qwen3")
    prompts = _workload(300)
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    got, stats = _generate(model_dir, prompts + prompts, greedy + seeded, tensor_parallel_size=2,
                           enable_prefix_caching=True, max_num_batched_tokens=8, max_num_seqs=4,
                           num_gpu_blocks_override=20)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    for p, out in zip(prompts, got[:len(prompts)]):
        assert out == hf_greedy(model_dir, p, MAX_NEW, eos=[])
    ample, _ = _generate(model_dir, prompts, seeded, enable_prefix_caching=False, async_scheduling=False)
    assert got[len(prompts):] == ample


@pytest.mark.parametrize("heads,kv_heads,inter,message", [
    (6, 2, 128, "does not divide the model's 6 attention heads"),
    (8, 6, 128, "does not divide the model's 6 KV heads"),
    (8, 3, 128, "3 KV heads cannot be replicated evenly"),
    (8, 2, 130, "intermediate size 130"),
])
def test_model_that_does_not_split_is_refused(tmp_path, heads, kv_heads, inter, message):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "num_attention_heads": heads, "vocab_size": 100,
                   "num_key_value_heads": kv_heads, "intermediate_size": inter}, f)
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model=str(tmp_path), tensor_parallel_size=4, device="cpu").resolve()
    EngineConfig(model=str(tmp_path), tensor_parallel_size=1, device="cpu").resolve()


def test_one_kv_head_replicates_and_tp_must_divide_over_nodes(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "vocab_size": 100,
                   "num_key_value_heads": 1, "intermediate_size": 64}, f)
    EngineConfig(model=str(tmp_path), tensor_parallel_size=8, device="cpu").resolve()
    with pytest.raises(ConfigError, match="--nnodes"):
        EngineConfig(model=str(tmp_path), tensor_parallel_size=2, nnodes=3, device="cpu").resolve()


def test_serve_tp2_has_two_workers_and_dies_with_either(tiny_model_dir, start_server):
    """`loom serve -tp 2`: one engine core with two worker processes. SIGKILL of rank 1 mid-stream:
    the stream ends with an error, /health is 503 within a second, loom serve exits non-zero,
    and no process, /dev/shm entry or ipc directory is left."""
    before = loom_ipc_dirs()
    server = start_server(tiny_model_dir, "-tp", "2", "--max-model-len", "512")
    engine = next(pid for pid in child_pids(server.proc.pid) if child_pids(pid))
    workers = child_pids(engine)
    assert len(workers) == 2, workers
    r = requests.post(server.url + "/v1/completions", stream=True, timeout=10,
                      json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True})
    events, killed_at = [], None
    for line in r.iter_lines():
        if not line:
            continue
        events.append(json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]")
        if len(events) == 5:
            os.kill(workers[1], signal.SIGKILL)
            killed_at = time.monotonic()
    assert killed_at is not None
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    while requests.get(server.url + "/health", timeout=2).status_code != 503:
        assert time.monotonic() - killed_at < 1.0, "/health still 200 a second after a rank died"
        time.sleep(0.02)
    server.proc.wait(15)
    assert server.proc.returncode not in (0, None)
    _assert_clean(before, server)
