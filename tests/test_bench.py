"""`loom bench`: the workload generator, presets, and the throughput and serve commands on CPU."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from bench.workloads import (OFFLINE_OUTPUT_TOKENS, OFFLINE_PROMPT_TOKENS, fixed_workload, make_workload,
                             offline_workload)
from tests.conftest import ROOT


def _loom(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_default_offline_workload_totals():
    wl = make_workload(None, None, None, seed=0)
    assert wl.is_default and len(wl) == 256
    assert wl.prompt_tokens == OFFLINE_PROMPT_TOKENS == 142_827
    assert wl.output_tokens == OFFLINE_OUTPUT_TOKENS == 133_966
    # the same stream as nano-vllm's bench.py (module-level random after random.seed(0))
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert wl.prompts == prompts and wl.max_tokens == max_tokens
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p in wl.prompts)
    # a tiny vocabulary wraps the ids but keeps every length
    small = offline_workload(vocab_size=300)
    assert [len(p) for p in small.prompts] == [len(p) for p in prompts] and small.max_tokens == max_tokens
    assert max(max(p) for p in small.prompts) < 300
    # DP=2's shards split it between them: every request once, the totals kept
    shards = [wl.shard(r, 2) for r in range(2)]
    assert not shards[0].is_default and [len(s) for s in shards] == [128, 128]
    assert shards[1].prompts[0] == wl.prompts[1] and shards[1].max_tokens[-1] == wl.max_tokens[-1]
    assert sum(s.prompt_tokens for s in shards) == OFFLINE_PROMPT_TOKENS
    assert sum(s.output_tokens for s in shards) == OFFLINE_OUTPUT_TOKENS


def test_fixed_workload():
    wl = fixed_workload(5, 12, 7, seed=3, vocab_size=50)
    assert [len(p) for p in wl.prompts] == [12] * 5 and wl.max_tokens == [7] * 5
    assert all(0 <= t < 50 for p in wl.prompts for t in p)
    assert not make_workload(4, 8, 8, seed=0).is_default


def test_preset_loads(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from bench.presets import PRESETS, num_params, write_preset
    from ipc.config import EngineConfig
    d = write_preset("llama-3.2-1b", str(tmp_path / "llama"))
    cfg = EngineConfig(model=d, load_format="dummy", max_model_len=4096).resolve()
    assert cfg.vocab_size == 128256 and cfg.eos_token_ids == [128001]
    hf = AutoConfig.from_pretrained(d)
    assert hf.hidden_size == 2048 and hf.num_hidden_layers == 16 and hf.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 128256 and tok.eos_token_id == 128001 and tok.bos_token_id == 128000
    assert all(tok.decode([i]) for i in (5, 300, 100000, 128255))   # every id decodes to text
    assert round(num_params(PRESETS["qwen3-0.6b"]) / 1e6) == 596
    assert round(num_params(PRESETS["llama-3.1-8b"]) / 1e6) == 8030
    assert round(num_params(PRESETS["qwen3-30b-a3b"]) / 1e8) == 305   # the mixtures: all experts counted
    assert round(num_params(PRESETS["mixtral-8x7b"]) / 1e8) == 467


def test_one_tp_rank_as_a_model(tmp_path):
    """bench.tp_targets --one-rank: a TP=1 config with one rank's shapes, which the engine resolves
    with its special ids inside the halved vocabulary."""
    from bench.presets import PRESETS, write_preset
    from bench.tp_targets import _write_rank_model, rank_config
    from ipc.config import EngineConfig
    r = rank_config(PRESETS["llama-3.1-70b"], 2)
    assert (r["num_attention_heads"], r["num_key_value_heads"], r["intermediate_size"], r["vocab_size"],
            r["head_dim"]) == (32, 4, 14336, 64128, 128)
    assert rank_config(PRESETS["llama-3.1-8b"], 16)["num_key_value_heads"] == 1   # replicated, as sharded
    assert rank_config({**PRESETS["qwen3-8b"], "vocab_size": 151937}, 2)["vocab_size"] == 75969  # padded
    d = write_preset("llama-3.2-1b", str(tmp_path / "rank"))
    with open(f"{d}/config.json") as f:
        _write_rank_model(d, rank_config(json.load(f), 2))
    cfg = EngineConfig(model=d, load_format="dummy", max_model_len=4096).resolve()
    assert cfg.vocab_size == 64128 and cfg.eos_token_ids == [64127]


def test_bench_throughput_tiny(model_factory, tmp_path):
    out = tmp_path / "tp.json"
    prof = tmp_path / "prof"
    r = _loom("throughput", "--model", model_factory("qwen3"), "--num-prompts", "4", "--input-len", "8",
              "--output-len", "8", "--output-json", str(out), "--sampling", "topp", "penalties", "logprobs", "n4seed",
              "--profiler-dir", str(prof), "--shard", "1/2", env={"LOOM_STEP_STATS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    # the plain run was traced (a CPU trace: no GPU kernels to sum), with the step stats' phase marks
    [trace] = prof.glob("throughput_*rank0*.json")
    assert "no kernels in" in r.stdout
    marks = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"loom.begin", "loom.prepare", "loom.forward", "loom.sample"} <= marks, marks
    assert any(m.startswith("loom.end.") for m in marks)
    res = json.loads(out.read_text())
    assert res["num_requests"] == 2 and res["shard"] == [1, 2]   # requests 1 and 3 of 4
    assert 0 < res["hbm_floor_s"] and "HBM floor" in r.stdout
    modes = res["sampling"]
    assert set(modes) == {"plain", "topp", "penalties", "logprobs", "n4sep", "n4seed"}
    assert modes["n4seed"]["baseline"] == "n4sep" and modes["topp"]["baseline"] == "plain"
    assert all(m["ratio"] > 0 for m in modes.values()) and "x of plain" in r.stdout
    assert res["prompt_tokens"] == 16 and res["output_tokens"] == 16
    assert res["output_tok_per_s"] > 0 and res["total_tok_per_s"] > res["output_tok_per_s"]
    assert "output tok/s" in r.stdout


def test_kernel_table_sums_device_time_and_gaps(tmp_path):
    from bench.kernel_trace import kernel_table, newest_trace
    events = [{"cat": "kernel", "name": "attn", "ts": 0, "dur": 30},
              {"cat": "kernel", "name": "gemm", "ts": 40, "dur": 20},   # 10 us idle before it
              {"cat": "kernel", "name": "attn", "ts": 50, "dur": 30},   # overlaps: no idle
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    path = tmp_path / "throughput_dp0_tp0_rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert newest_trace(str(tmp_path), "throughput") == str(path)
    lines = kernel_table(str(path), per=2, unit="step")
    assert lines[0].startswith("3 kernels: 0.040 ms of kernels per step, GPU span 0.040 ms, idle between "
                               "kernels 0.005 ms")
    assert lines[1].split() == ["0.030", "ms", "attn"] and lines[2].split() == ["0.010", "ms", "gemm"]


def test_trace_gaps_names_the_host_phase_that_queued_each_gap_late(tmp_path):
    """bench.trace_gaps: each device gap is traced to the launch of the op after it (correlation id)
    and to the phase whose end mark comes next on the host; a launch before the gap began is not late."""
    from bench.trace_gaps import BETWEEN, gaps, report

    def kernel(name, ts, dur, corr):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "args": {"correlation": corr}}

    def mark(name, ts):
        return {"cat": "user_annotation", "name": name, "ts": ts, "dur": 0}

    events = [mark("loom.begin", 0), launch(1, 1), mark("loom.prepare", 10), launch(395, 2),
              mark("loom.encoder", 400), mark("loom.forward", 420), mark("loom.end.eager", 430), launch(880, 3),
              mark("loom.begin", 900), mark("loom.forward", 960),
              kernel("copy", 20, 100, 1),        # then idle 120..600: queued at 395, in the encoder phase
              kernel("tower", 600, 50, 2),
              kernel("gemm", 1000, 10, 3)]       # idle 650..1000: queued at 880, between steps
    found, span, busy = gaps(events, 50)
    assert span == 1010 - 20 and busy == 160
    assert [(g.us, g.phase, g.late_us) for g in found] == [(480, "encoder", 275), (350, BETWEEN, 230)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    lines = report(str(path))
    assert lines[0].startswith("device span 1.0 ms, busy 0.2 ms") and "0.8 ms (83.8%) in 2 gaps" in lines[0]
    assert lines[2].split() == ["encoder", "1", "0.5", "0.5"] and lines[3].split()[-3:] == ["1", "0.3", "0.3"]


# (the LoRA mode lists every op: whether the LoRA ops are in the step, not where they rank by CPU time,
# which a busy 2-core box reorders)
@pytest.mark.parametrize("mode", [["--query-len", "1", "5"], ["--prefill"], ["--lora-adapters", "3", "--top", "500"]])
def test_bench_profile_step_tiny(model_factory, mode):
    r = _loom("profile-step", "--model", model_factory("qwen3"), "--device", "cpu", "--batch", "2",
              "--context", "20", "--iters", "2", *mode)
    assert r.returncode == 0, r.stdout + r.stderr
    kind = "prefill" if "--prefill" in mode else "decode"
    assert f"{kind} batch 2, context 20" in r.stdout and "launches (floor" in r.stdout
    if "--query-len" in mode:   # and a verify step of 4 drafts per sequence beside it
        assert "decode batch 2, context 20, 5 tokens each:" in r.stdout
    if "--lora-adapters" in mode:   # the LoRA ops (torch references on the CPU) are in the step
        assert "3 adapters of rank 16:" in r.stdout and "aten::_unique2" in r.stdout


def test_bench_step_host_tiny(model_factory):
    r = _loom("step-host", "--model", model_factory("qwen3"), "--device", "cpu", "--batch", "2", "--context", "9",
              "--steps", "10", "--profile", "3", "--profile-steps", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "batch 2, context 9, temperature 1.0, cpu, eager: 10 decode steps" in r.stdout
    assert "launch" in r.stdout and "torch operators per step" in r.stdout


def test_bench_serve_tiny(model_factory, start_server, tmp_path):
    server = start_server(model_factory("qwen3"))
    out = tmp_path / "serve.json"
    r = _loom("serve", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "10",
              "--random-output-len", "5", "--request-rate", "50", "--max-concurrency", "3", "--seed", "1",
              "--disable-tqdm", "--result-file", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["total_input_tokens"] == 60 and res["total_output_tokens"] == 30
    assert res["output_lens"] == [5] * 6 and res["input_lens"] == [10] * 6
    assert res["peak_concurrency"] <= 3
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert res[key] > 0, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p90", "p99", "std"):
            assert f"{stat}_{metric}_ms" in res, (stat, metric)
        if metric != "itl":  # a tiny byte-level tokenizer can put several tokens into one chunk
            assert res[f"mean_{metric}_ms"] > 0, metric
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    assert "Serving Benchmark Result" in r.stdout

    # the same load from 2 processes (3 + 3 requests, concurrency 2 + 1): every request's result,
    # in the load's order, and the metrics over all of them together
    out2 = tmp_path / "serve2.json"
    r = _loom("serve", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "10",
              "--random-output-len", "5", "--request-rate", "50", "--max-concurrency", "3", "--seed", "1",
              "--disable-tqdm", "--result-file", str(out2), "--num-processes", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    two = json.loads(out2.read_text())
    assert two["completed"] == 6 and two["failed"] == 0 and two["peak_concurrency"] <= 3
    assert two["total_output_tokens"] == 30 and two["output_lens"] == [5] * 6
    e2els = [1000 * x for x in two["e2els"]]
    assert two["mean_e2el_ms"] == pytest.approx(sum(e2els) / 6)
    assert two["output_throughput"] == pytest.approx(30 / two["duration"])
    assert two["duration"] >= max(e2els) / 1000
    assert "Serving Benchmark Result" in r.stdout


def test_bench_serve_load_split_and_merged_in_order():
    from bench.serve import Load, arrival_offsets, interleave
    offsets = arrival_offsets(10, 5.0, seed=3)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] > 0
    assert arrival_offsets(4, float("inf"), 0) == [0.0] * 4
    load = Load("u", {}, [{"i": i} for i in range(10)], offsets, 5)
    shares = [load.share(k, 3) for k in range(3)]
    assert [s.concurrency for s in shares] == [2, 2, 1]
    assert interleave([s.payloads for s in shares]) == load.payloads
    assert interleave([s.offsets for s in shares]) == offsets
    assert load.share(0, 2).concurrency == 3 and Load("u", {}, [], [], None).share(1, 2).concurrency is None


def test_decode_steps_time_only_the_free_batch():
    """bench/structured.py's compile stall: a step counts only if it and two neighbours on each side
    ran exactly the free batch (a joining request's prefill step is its own cost), and it is marked
    as compiling while a request waits for its grammar."""
    from types import SimpleNamespace as S

    from bench.structured import decode_steps
    # (scheduled tokens, prompt tokens, waiting) per step; step 0 is the batch's prefill
    shape = [(4 * 64, 256, 2)] + [(4, 0, 2)] * 6 + [(4 + 8, 8, 1)] + [(4, 0, 1)] * 6 + [(4, 0, 0)] * 5
    log = [(0.01 * i + (0.5 if i > 7 else 0), S(num_scheduled_tokens=n, num_prompt_tokens=p, num_waiting=w))
           for i, (n, p, w) in enumerate(shape)]
    steps = decode_steps(log, batch=4)
    # by position from the first decode step (log index 1): the steps within 2 of the prefill
    # (index 0), of the join (index 7, whose slow step is the gap at index 8) and of the end are out
    assert sorted(steps) == [2, 3, 9, 10, 11, 12, 13, 14, 15]
    assert all(abs(dt - 0.01) < 1e-9 for dt, _ in steps.values())
    assert [steps[p][1] for p in sorted(steps)] == [True] * 6 + [False] * 3


def test_logprobs_host_bench_tiny(model_factory):
    """bench/logprobs_host.py drives the worker's, the engine's and the client's own code."""
    from bench.logprobs_host import run
    report = run(rows=8, steps=6, n=3, model_dir=model_factory("qwen3"))
    assert set(report) == {"plain", "logprobs"}
    assert all(v >= 0 for stages in report.values() for v in stages.values())


def test_step_stats_splits_host_time_by_phase():
    """LOOM_STEP_STATS: a step's host time is split into the phases its caller marks, and its
    finishing's host time is apart; a step with no marks (the encoder's) has only its total."""
    import time

    import torch

    from workers.step_stats import StepStats
    stats = StepStats(torch.device("cpu"))
    token = stats.begin()
    for phase in ("prepare", "forward", "sample"):
        time.sleep(0.002)
        stats.lap(token, phase)
    stats.finished(stats.end(token, "piecewise", 40), host_s=0.003)   # (its finish: tokens recorded, drafts)
    stats.finished(stats.end(stats.begin(), "encoder", 3))
    s = stats.summary()
    step = s["piecewise"]
    assert step["steps"] == 1 and step["tokens"] == 40
    assert all(step[f"host_ms_{p}"] >= 2.0 for p in ("prepare", "forward", "sample"))
    assert step["host_ms_finish"] == pytest.approx(3.0)
    assert sum(step[f"host_ms_{p}"] for p in ("prepare", "forward", "sample")) <= step["host_ms_per_step"]
    assert not any(k.startswith("host_ms_") and k != "host_ms_per_step" for k in s["encoder"])


def test_step_stats_reads_an_encoder_between_the_steps_around_it():
    """A step's encoder is launched inside it, before its own device work, while the step before
    is still running (async pipeline): its mark is read after that step's and before its own, so
    each idle is the gap to the work just before it (read at once, the encoder's idle held the
    whole previous step)."""
    import torch

    from workers.step_stats import StepMark, StepStats

    class Event:   # a fired CUDA event at time t (ms)
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, later):
            return later.t - self.t

        def query(self):
            return True

    stats = StepStats(torch.device("cpu"))
    prev = StepMark("graph", Event(0.0), Event(6.0), 8, [])
    encoder = StepMark("encoder", Event(10.0), Event(68.0), 4, [])
    step = StepMark("eager+encoder", Event(70.0), Event(200.0), 4000, [encoder])
    stats.finished(prev)
    stats.finished(step)
    assert stats.idle_s["encoder"] == pytest.approx(0.004) and stats.device_s["encoder"] == pytest.approx(0.058)
    assert stats.idle_s["eager+encoder"] == pytest.approx(0.002) and stats.idle_s["graph"] == 0


def test_trace_steps_counts_a_step_with_its_head_graph_as_one():
    """A decode step replays the model graph, then the head graph (two launches, no op between):
    one step, from its first graph kernel to the next step's."""
    from bench.trace_steps import split_steps
    op = lambda name, corr: {"name": name, "args": {"correlation": corr}}
    ops = [op("h2d", 90), op("model", 1), op("model", 1), op("head", 2), op("d2h", 91),
           op("h2d", 92), op("model", 3), op("d2h", 93), op("h2d", 94), op("model", 5)]
    steps = split_steps(ops, graph_launches={1, 2, 3, 5})
    assert [[o["name"] for o in s] for s in steps] == [["model", "model", "head", "d2h", "h2d"], ["model", "d2h", "h2d"]]


def test_moe_presets_are_hf_configs():
    """The MoE presets read as their transformers configs with the published shapes, and name
    architectures Loom registers."""
    import transformers

    from bench.presets import PRESETS
    from workers.models.registry import MODELS
    q = transformers.Qwen3MoeConfig(**PRESETS["qwen3-30b-a3b"])
    assert (q.num_hidden_layers, q.hidden_size, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size,
            q.num_attention_heads, q.num_key_value_heads, q.head_dim, q.vocab_size) == \
        (48, 2048, 128, 8, 768, 32, 4, 128, 151936)
    m = transformers.MixtralConfig(**PRESETS["mixtral-8x7b"])
    assert (m.num_hidden_layers, m.hidden_size, m.num_local_experts, m.num_experts_per_tok,
            m.intermediate_size) == (32, 4096, 8, 2, 14336)
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):
        assert PRESETS[name]["architectures"][0] in MODELS


def test_long_context_floors_and_summary(tmp_path, capsys):
    # the floor: ~1 s of prefill attention at half of peak + ~1.8 s of decode KV reads, 3.7 s at 75%
    from bench import long_context as lc
    prefill, kv = lc.e2e_floor_s()
    assert 0.95 < prefill < 1.05 and 1.75 < kv < 1.85 and (prefill + kv) / 0.75 == pytest.approx(3.73, abs=0.01)
    assert lc.decode_bytes(16, 16384) == 16 * 16384 * 8 * 128 * 2 * 2
    assert lc.prefill_flops(2, 5) == 4 * (2 * 3 + 3) * 128 * 16   # 2 queries after 3 keys see 4 and 5 keys
    rows = [dict(kernel="k", variant=v, us=us, floor_us=50.0, rate="x", err=0.0, default=d)
            for v, us, d in (("short (before)", 200.0, False), ("a", 100.0, True), ("b", 80.0, False))]
    rows += [dict(kernel="decode", variant=v, us=us, floor_us=250.0, rate="x", err=0.0, default=d)
             for v, us, d in (("default", 317.0, True), ("8 splits", 267.0, False))]
    (tmp_path / "long-kernels.json").write_text(json.dumps(rows))
    (tmp_path / "long-e2e.json").write_text(json.dumps({"elapsed_s": 3.5}))
    lc.summary(str(tmp_path))
    out = capsys.readouterr().out
    assert "<- fastest" in out and " 62.5%" in out and "failed" in out and "yes" in out
    assert f"{3.5 - 50e-6 * 28 * 256:10.2f}" in out   # the projection with the faster decode
