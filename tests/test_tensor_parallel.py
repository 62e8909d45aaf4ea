"""Tensor parallelism for real on CPU: two worker processes in one gloo group.

Greedy output at TP=2 equals HF transformers (fp32) for Qwen2 (q/k/v biases) and Qwen3 (q/k
norms, with one KV head replicated on both ranks and a vocabulary of 337 padded to split); and
stays the same under prefix caching, chunked prefill and preemption, for seeded sampling too
(every rank samples the same tokens).
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
from ipc.sampling_params import StructuredOutputsParams
from ipc.sockets import free_tcp_port
from tests.conftest import child_pids
from tests.hf_oracle import hf_greedy

MAX_NEW = 10


def _prompts(vocab: int, lengths=(3, 17, 9, 30)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in lengths]


def test_qwen2_biases_match_hf_and_control_reaches_every_rank(model_factory):
    """Qwen2 (q/k/v biases) at TP=2 equals HF; collective_rpc answers per rank; after sleep
    (level 1: each rank offloads its shard) and wake-up, and a keep-pause, output is the same."""
    model_dir = model_factory("qwen2")
    prompts = _prompts(300)
    llm = LLM(model_dir, tensor_parallel_size=2, block_size=4, max_num_seqs=2, max_model_len=128,
              enable_sleep_mode=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    try:
        first = [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert first == [hf_greedy(model_dir, p, MAX_NEW, llm.config.eos_token_ids) for p in prompts]
        info = llm.collective_rpc("all_reduce_info")
        assert [(i["rank"], i["size"], i["backend"]) for i in info] == [(0, 2, "gloo"), (1, 2, "gloo")]
        assert len(set(llm.collective_rpc("get_pid"))) == 2
        llm.sleep(1)
        llm.wake_up()
        llm.pause(mode="keep")
        llm.resume()
        again = [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert again == first
    finally:
        llm.shutdown()


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


def test_qwen3_one_kv_head_uneven_vocab_under_prefix_caching_chunking_and_preemption(model_factory):
    """One TP=2 engine with every schedule at once: a shared prefix (prefix hits), a step budget
    of 8 tokens (every prompt chunked) and a KV cache of 20 blocks (preemptions). Greedy rows
    equal HF; seeded rows equal an ample TP=1 run. Most rows sample plainly (greedy, temperature,
    min-p): their steps sample from each rank's vocabulary shard (LogitsShard); a top-p row's
    steps gather the logits. The model has one KV head (replicated on both ranks) and a
    vocabulary of 337 (padded to split: the last rank's padding row must never be drawn). One
    seeded row is regex-constrained with a repetition penalty."""
    model_dir = model_factory("qwen3", num_key_value_heads=1, vocab_size=337)
    prompts = _workload(337)
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9 if i == 5 else 1.0, min_p=0.05 * (i % 2), seed=100 + i,
                             max_tokens=MAX_NEW, ignore_eos=True) for i in range(len(prompts))]
    # a constrained row with a penalty: its steps sample after their bitmask comes, every rank's
    # next step built meanwhile (workers/step_pipeline.py), with the gathered logits
    seeded[2] = SamplingParams(temperature=0.9, seed=102, max_tokens=MAX_NEW, repetition_penalty=1.3,
                               structured_outputs=StructuredOutputsParams(regex="[a-z]{2,9}( [a-z]{2,9})*"))
    got, stats = _generate(model_dir, prompts + prompts, greedy + seeded, tensor_parallel_size=2,
                           enable_prefix_caching=True, max_num_batched_tokens=8, max_num_seqs=4,
                           num_gpu_blocks_override=20)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    for p, out in zip(prompts, got[:len(prompts)]):
        assert out == hf_greedy(model_dir, p, MAX_NEW, eos=[])
    # the TP=1 reference in this process: its engine's processes are not what is tested here
    ample, _ = _generate(model_dir, prompts, seeded, multiprocess=False, enable_prefix_caching=False,
                         async_scheduling=False)
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


@pytest.mark.parametrize("arch,sizes", [("Qwen3MoeForCausalLM", {"intermediate_size": 128, "moe_intermediate_size": 30}),
                                        ("MixtralForCausalLM", {"intermediate_size": 30, "num_local_experts": 8})])
def test_experts_that_do_not_split_need_expert_parallelism(tmp_path, arch, sizes):
    """An expert width the ranks do not divide is refused under TP, and served under EP (whole
    experts per rank)."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": [arch], "num_attention_heads": 8, "vocab_size": 100, "num_key_value_heads": 4,
                   **sizes}, f)
    with pytest.raises(ConfigError, match="expert intermediate size 30 .*--enable-expert-parallel"):
        EngineConfig(model=str(tmp_path), tensor_parallel_size=4, device="cpu").resolve()
    EngineConfig(model=str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=True, device="cpu").resolve()


def test_shared_expert_must_split(tmp_path):
    """Qwen2-MoE's shared expert is tensor-parallel under EP too: its width must split."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen2MoeForCausalLM"], "num_attention_heads": 8, "vocab_size": 100,
                   "num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 30}, f)
    for ep in (False, True):
        with pytest.raises(ConfigError, match="shared expert intermediate size 30"):
            EngineConfig(model=str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=ep, device="cpu").resolve()


def test_one_kv_head_replicates_and_tp_must_divide_over_nodes(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "vocab_size": 100,
                   "num_key_value_heads": 1, "intermediate_size": 64}, f)
    EngineConfig(model=str(tmp_path), tensor_parallel_size=8, device="cpu").resolve()
    with pytest.raises(ConfigError, match="--nnodes"):
        EngineConfig(model=str(tmp_path), tensor_parallel_size=2, nnodes=3, device="cpu").resolve()


def _assert_nothing_left(server, tmpdir: str, pids: list[int]) -> None:
    """No process of the server's session, no ipc directory in its private TMPDIR, no /dev/shm
    entry named after one of its processes (other servers may run on this host meanwhile)."""
    deadline = time.monotonic() + 10
    while True:
        left = {"processes": server.descendants(), "ipc": os.listdir(tmpdir),
                "shm": [n for n in os.listdir("/dev/shm") if any(f"_{pid}_" in n for pid in pids)]}
        if not any(left.values()):
            return
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.2)


def test_serve_tp2_has_two_workers_and_dies_with_either(tiny_model_dir, start_server):
    """`loom serve -tp 2`: one engine core with two worker processes. SIGKILL of rank 1 mid-stream:
    the stream ends with an error, /health is 503 within a second, loom serve exits non-zero,
    and no process, /dev/shm entry or ipc directory is left."""
    import shutil
    import tempfile
    tmpdir = tempfile.mkdtemp(prefix="tp", dir="/tmp")  # short: unix socket paths are limited
    try:
        server = start_server(tiny_model_dir, "-tp", "2", "--max-model-len", "512", env={"TMPDIR": tmpdir})
        engine = next(pid for pid in child_pids(server.proc.pid) if child_pids(pid))
        workers = child_pids(engine)
        assert len(workers) == 2, workers
        pids = server.descendants()
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
        _assert_nothing_left(server, tmpdir, pids)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _free_port_block(n: int) -> int:
    """A port p with p .. p+n-1 free (the rendezvous, the step broadcast, the replies)."""
    import socket
    for _ in range(50):
        base = free_tcp_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def test_two_nodes_on_loopback_match_one_node(tiny_model_dir, start_server):
    """Two `loom serve` commands as two nodes (rank 1 headless, reading the steps from node 0's
    CURVE socket): the same greedy tokens as one node (= HF). SIGKILL of node 1's worker: node 0
    answers 503 within a second and exits non-zero; node 1 exits non-zero too."""
    import openai
    port = _free_port_block(3)
    common = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--engine-auth-key", "two-node-test-key", "--max-model-len", "128"]
    node1 = start_server(tiny_model_dir, "--headless", "--node-rank", "1", *common, wait=False)
    head = start_server(tiny_model_dir, *common)
    client = openai.OpenAI(base_url=head.url + "/v1", api_key="none")
    prompts = _prompts(300, (5, 23))
    for p in prompts:
        out = client.completions.create(model=tiny_model_dir, prompt=p, max_tokens=MAX_NEW, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == hf_greedy(tiny_model_dir, p, MAX_NEW, eos=[]), p
    workers = child_pids(node1.proc.pid)
    assert len(workers) == 1 and len(child_pids(next(pid for pid in child_pids(head.proc.pid)
                                                     if child_pids(pid)))) == 1
    os.kill(workers[0], signal.SIGKILL)
    killed_at = time.monotonic()
    while requests.get(head.url + "/health", timeout=2).status_code != 503:
        assert time.monotonic() - killed_at < 1.0, "/health still 200 a second after node 1's worker died"
        time.sleep(0.02)
    assert head.proc.wait(15) not in (0, None)
    assert node1.proc.wait(15) not in (0, None)


def test_serve_refuses_in_one_line_with_exit_2(tmp_path, tiny_model_dir):
    """Impossible TP configurations stop `loom serve` before any process starts: one line, exit 2."""
    import subprocess
    import sys
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6, "vocab_size": 100,
                   "num_key_value_heads": 2, "intermediate_size": 64}, f)
    cases = [([str(tmp_path), "-tp", "4", "--device", "cpu"], "does not divide the model's 6 attention heads")]
    if not torch_cuda_count():
        # no GPU at all: the device check speaks first (ipc/config.py check_device)
        cases.append(([tiny_model_dir, "-tp", "2", "--device", "cuda"], "no CUDA GPU is visible"))
    for args, message in cases:
        r = subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "serve", *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], r.stderr


def torch_cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_ring_publishes_every_step_to_remote_readers_holding_the_key():
    """The ring's TCP side, without models: a remote reader with the key gets every message, in
    order, inline and overflow alike, as the local reader does; one with another key gets
    nothing; closing the ring ends the remote reader."""
    import shutil
    import tempfile

    from shm.broadcast_ring import BroadcastRing, RemoteHandle, RemoteReader, RemoteSpec, RingClosed
    ipc_dir = tempfile.mkdtemp(prefix="tpr", dir="/tmp")
    addr = f"tcp://127.0.0.1:{_free_port_block(1)}"
    ring = BroadcastRing.create(1, ipc_dir, remote=RemoteSpec(addr, (1,), "the-key"))
    readers = []
    try:
        local = BroadcastRing.attach(ring.handle(), 0)
        remote = RemoteReader(RemoteHandle(addr, "the-key"), 1)
        stranger = RemoteReader(RemoteHandle(addr, "another-key"), 1)
        readers = [local, remote, stranger]
        ring.wait_until_ready(timeout=10)
        big = os.urandom(3 << 20)  # larger than a chunk: the overflow path locally
        messages = [[b"\x01", b"step one"], [big], [b"\x02", b"", b"three"]]
        for m in messages:
            ring.enqueue(m)
        for m in messages:
            assert [bytes(f) for f in local.dequeue(5)] == m
            assert [bytes(f) for f in remote.dequeue(5)] == m
        with pytest.raises((TimeoutError, RingClosed)):
            stranger.dequeue(1.0)
        ring.close()
        with pytest.raises(RingClosed):
            remote.dequeue(5)
    finally:
        for r in readers:
            r.close()
        ring.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _build_as_rank(monkeypatch, model_dir, rank, size, load_format="auto"):
    import torch

    from workers import distributed
    from workers.model_loader import load_model
    monkeypatch.setattr(distributed, "_state", distributed.TPState(rank=rank, size=size))
    try:
        return load_model(model_dir, torch.float32, "cpu", load_format)
    finally:
        monkeypatch.setattr(distributed, "_state", distributed.TPState())


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_each_rank_holds_the_tp1_model_sharded(model_factory, monkeypatch, load_format):
    """Built as rank r of 2 (no group needed to build), from the checkpoint read as slices or
    with dummy weights, every parameter equals the TP=1 model's parameter cut by its loader;
    the one KV head is on both ranks, the vocabulary's padding row is zero."""
    import torch
    model_dir = model_factory("llama", num_key_value_heads=1, vocab_size=337)
    full = dict(_build_as_rank(monkeypatch, model_dir, 0, 1, load_format).named_parameters())
    for rank in range(2):
        part = _build_as_rank(monkeypatch, model_dir, rank, 2, load_format)
        for name, p in part.named_parameters():
            expect = torch.empty_like(p)
            expect.weight_loader = p.weight_loader
            p.weight_loader(expect, full[name])
            assert torch.equal(p, expect), (rank, name)
        attn = part.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        k_rows = attn.qkv_proj.weight[attn.q_size:attn.q_size + attn.kv_size]
        torch.testing.assert_close(k_rows, full["model.layers.0.self_attn.qkv_proj.weight"][64:80])
        assert part.lm_head.weight.shape == (169, 64)
    assert bool((part.lm_head.weight[-1] == 0).all())  # id 337 of 338: padding
