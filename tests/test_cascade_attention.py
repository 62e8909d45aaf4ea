"""Cascade (prefix-aware) attention: the kernels against paged attention's reference (Triton in
the interpreter on CPU, compiled on CUDA), the runner's common-prefix detection and heuristic,
and whole engines with cascade on and off giving the same greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cascade_attention as ca
from kernels import paged_attention as pa
from kernels.jit import is_interpreted

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not is_interpreted(pa._paged_attention_kernel),
                                  reason="triton was imported without TRITON_INTERPRET=1")


def _shared_prefix_batch(prefix_len: int, own: list[int], q_lens: list[int], hkv: int, group: int, d: int,
                         bs: int, dtype=torch.float32, seed: int = 0):
    """Sequences whose first prefix_len keys lie in the same (shuffled) blocks, then own[i] keys
    of their own; the last q_lens[i] tokens of each are its queries. NaN in every slot no
    sequence wrote (a kernel must not read one)."""
    g = torch.Generator().manual_seed(seed)
    assert prefix_len % bs == 0
    n_blocks = [-(-(prefix_len + o) // bs) for o in own]
    total = prefix_len // bs + sum(n - prefix_len // bs for n in n_blocks) + 2
    perm = torch.randperm(total, generator=g).tolist()
    shared, rest = perm[:prefix_len // bs], perm[prefix_len // bs:]
    bt = torch.full((len(own), max(n_blocks) + 1), 10_000, dtype=torch.int32)
    for i, n in enumerate(n_blocks):
        mine, rest = rest[:n - len(shared)], rest[n - len(shared):]
        bt[i, :n] = torch.tensor(shared + mine, dtype=torch.int32)
    kc = torch.randn(total, bs, hkv, d, generator=g)
    vc = torch.randn(total, bs, hkv, d, generator=g)
    written = torch.zeros((total, bs), dtype=torch.bool)
    for i, o in enumerate(own):
        for p in range(prefix_len + o):
            written[bt[i, p // bs], p % bs] = True
    kc[~written], vc[~written] = float("nan"), float("nan")
    seq_lens = torch.tensor([prefix_len + o for o in own], dtype=torch.int32)
    qsl = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hkv * group, d, generator=g)
    on = dict(device=DEVICE)
    return (q.to(dtype=dtype, **on), kc.to(dtype=dtype, **on), vc.to(dtype=dtype, **on), qsl.to(**on),
            seq_lens.to(**on), bt.to(**on))


def _prefix(prefix_len: int, num_tokens: int, bt: torch.Tensor, bs: int, prefix_splits: int,
            suffix_splits: int) -> ca.CascadePrefix:
    return ca.CascadePrefix(torch.tensor([0, num_tokens], dtype=torch.int32, device=bt.device),
                            torch.tensor([prefix_len], dtype=torch.int32, device=bt.device),
                            bt[:1, :prefix_len // bs], prefix_splits, suffix_splits)


def test_reference_equals_paged_attention_reference():
    # the torch reference of cascade (prefix and suffix apart, merged by log-sum-exp) is attention
    q, kc, vc, qsl, sl, bt = _shared_prefix_batch(16, [3, 1, 9, 6], [1, 1, 4, 6], 2, 3, 16, 4, seed=1)
    want = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.25)
    got = ca.cascade_attention_ref(q, kc, vc, qsl, sl, bt, 0.25, 16)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    capped = ca.cascade_attention_ref(q, kc, vc, qsl, sl, bt, 0.25, 16, logits_soft_cap=2.0)
    torch.testing.assert_close(capped, pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.25, logits_soft_cap=2.0),
                               atol=2e-6, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("prefix_splits,suffix_splits", [(1, 1), (4, 1), (2, 2)])
def test_cascade_decode_batch_exact_in_fp32(prefix_splits, suffix_splits):
    # 16 decodes sharing a 3-block prefix, own contexts 1-23 keys, GQA 2: cascade == plain, fp32
    own = [1, 5, 9, 13, 2, 23, 4, 8, 16, 3, 7, 11, 6, 1, 19, 10]
    q, kc, vc, qsl, sl, bt = _shared_prefix_batch(12, own, [1] * 16, 2, 2, 16, 4)
    want = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.25)
    order = torch.argsort(-sl.long(), stable=True).to(torch.int32)
    got = ca.cascade_attention(q, kc, vc, qsl, sl, bt, 0.25, 1, _prefix(12, 16, bt, 4, prefix_splits, suffix_splits),
                               num_decodes=16, seq_order=order)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_triton
def test_cascade_mixed_batch_softcap_and_out_buffer():
    # decodes then prompt chunks (two suffix launches), a soft cap, written into a given buffer
    q, kc, vc, qsl, sl, bt = _shared_prefix_batch(8, [2, 6, 5, 11], [1, 1, 5, 9], 2, 4, 16, 4, seed=3)
    want = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.3, logits_soft_cap=3.0)
    out = torch.full_like(q, float("nan"))
    got = ca.cascade_attention(q, kc, vc, qsl, sl, bt, 0.3, 9, _prefix(8, q.shape[0], bt, 4, 2, 1), num_decodes=2,
                               out=out, logits_soft_cap=3.0)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_triton
def test_cascade_bf16_within_bf16_tolerance():
    q, kc, vc, qsl, sl, bt = _shared_prefix_batch(16, [4, 9, 1, 7], [1] * 4, 2, 2, 16, 8, dtype=torch.bfloat16)
    want = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.25).float()
    got = ca.cascade_attention(q, kc, vc, qsl, sl, bt, 0.25, 1, _prefix(16, 4, bt, 8, 2, 1), num_decodes=4)
    assert (got.float() - want).abs().max().item() < 2e-2


@needs_triton
def test_cascade_with_long_prefill_flags(monkeypatch):
    # the long-prefill path's flags forced on at small tiles (CAUSAL_SPLIT, HEAVY_FIRST): the prefix
    # launch stays non-causal, the suffix's chunks split their keys from kv_begin on; exact. And no
    # cascade launch asks the tile rule for the long-prefill tiles (it sees no keys: max_seq_len 0)
    original, seen = pa.tile_config, []

    def forced(*args):
        seen.append(args[6])
        return {**original(*args), "block_m": 16, "block_n": 16, "causal_split": True, "heavy_first": True}

    monkeypatch.setattr(pa, "tile_config", forced)
    q, kc, vc, qsl, sl, bt = _shared_prefix_batch(16, [2, 6, 21, 40], [1, 1, 17, 33], 2, 2, 16, 4, seed=4)
    want = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.3)
    got = ca.cascade_attention(q, kc, vc, qsl, sl, bt, 0.3, 33, _prefix(16, q.shape[0], bt, 4, 2, 1), num_decodes=2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert seen and set(seen) == {0}, seen


@needs_triton
@pytest.mark.parametrize("prefix_splits,suffix_splits", [(1, 1), (4, 2)])
def test_graph_inputs_one_prefix_object_serves_every_length(prefix_splits, suffix_splits):
    # as a decode graph captures it (DecodeGraphs: CascadePlanner.graph_prefix): the length a
    # device tensor the step refills, the blocks row 0 of the whole table, the splits fixed, and
    # padding rows past the batch (one key of context, slot 0's block, as the staging pads them).
    # Each length gives the plain path's result in fp32; padding rows stay finite
    own = [13, 5, 9, 17, 2, 23, 4, 8, 16, 3, 7, 11]
    q, kc, vc, qsl, sl, bt = _shared_prefix_batch(12, own, [1] * 12, 2, 2, 16, 4, seed=5)
    pad = 4
    q = torch.cat([q, torch.randn(pad, *q.shape[1:], dtype=q.dtype, device=q.device)])
    qsl = torch.arange(12 + pad + 1, dtype=torch.int32, device=q.device)
    sl_all = torch.cat([sl, torch.ones(pad, dtype=torch.int32, device=q.device)])
    bt_all = torch.cat([bt, torch.zeros((pad, bt.shape[1]), dtype=torch.int32, device=q.device)])
    order = torch.cat([torch.argsort(-sl.long(), stable=True).to(torch.int32),
                       torch.arange(12, 12 + pad, dtype=torch.int32, device=q.device)])
    length = torch.zeros(1, dtype=torch.int32, device=q.device)
    prefix = ca.CascadePrefix(torch.tensor([0, 12 + pad], dtype=torch.int32, device=q.device), length, bt_all[:1],
                              prefix_splits, suffix_splits)
    want = pa.paged_attention_ref(q[:12], kc, vc, qsl[:13], sl, bt, 0.25)
    out = torch.empty_like(q)
    for prefix_len in (12, 8, 4):   # (any whole-block prefix every sequence has computed)
        length.fill_(prefix_len)
        out.fill_(float("nan"))
        ca.cascade_attention(q, kc, vc, qsl, sl_all, bt_all, 0.25, 1, prefix, num_decodes=12 + pad, seq_order=order,
                             out=out)
        torch.testing.assert_close(out[:12], want, atol=2e-5, rtol=1e-5)
        assert torch.isfinite(out[12:]).all()


def test_split_choices():
    cpu = torch.device("cpu")   # sm_count: 4
    assert ca.choose_prefix_splits(512, 2, 8, 2048, cpu) == 1          # 128 programs: enough
    assert ca.choose_prefix_splits(16, 2, 2, 2048, cpu) == 8           # 2 programs, 4 per SM wanted on 4
    assert ca.choose_prefix_splits(16, 2, 1, 300, cpu) == 1            # too few keys to split
    assert ca.choose_suffix_splits(4, 2, 7, 5000, cpu) == 1            # a prompt chunk: unsplit


# --------------------------------------------------------------------------
# the runner's decision
# --------------------------------------------------------------------------

def test_common_prefix_blocks():
    from workers.cascade_attn import common_prefix_blocks
    bt = np.array([[4, 9, 2, 7], [4, 9, 2, 8], [4, 9, 5, 1]], dtype=np.int32)
    assert common_prefix_blocks(bt) == 2
    assert common_prefix_blocks(bt[:2]) == 3
    assert common_prefix_blocks(np.array([[4, 9], [5, 9]], dtype=np.int32)) == 0   # first column differs
    assert common_prefix_blocks(bt[:1]) == 0                                       # one request: nothing shared
    assert common_prefix_blocks(np.array([[3, 3], [3, 3]], dtype=np.int32)) == 2


def test_heuristic():
    from workers.cascade_attn import use_cascade_attention
    qwen3 = dict(num_q_heads=16, num_kv_heads=8, head_dim=128, kv_elem_bytes=2)
    ones = np.ones(512, np.int64)
    assert use_cascade_attention(2048, ones, **qwen3)                 # the shared-prefix row
    assert use_cascade_attention(1024, ones[:64], **qwen3)
    assert not use_cascade_attention(240, ones, **qwen3)              # too short a prefix (vLLM: 256)
    assert not use_cascade_attention(2048, ones[:7], **qwen3)         # too few requests (vLLM: 8)
    assert not use_cascade_attention(256, ones[:8], **qwen3)          # the extra launches cost more
    chunks = np.full(8, 1024)
    assert not use_cascade_attention(2048, chunks, **qwen3)           # prompt chunks: the same FLOPs either way
    assert use_cascade_attention(2048, np.concatenate([ones, chunks[:1]]), **qwen3)   # decodes and a chunk


# --------------------------------------------------------------------------
# whole engines: cascade on == off
# --------------------------------------------------------------------------

def greedy_with_cascade(model_dir: str, prompts: list[list[int]], mode: str, monkeypatch, max_tokens: int,
                        **options) -> tuple[list, int]:
    """Greedy tokens of an in-process engine (LLM options as given) with LOOM_CASCADE_ATTN=mode,
    and how many attention calls ran as cascade (tests/test_gpu_cascade.py's too)."""
    from frontend import LLM, SamplingParams
    calls = []
    real = ca.cascade_attention

    def counted(*args, **kwargs):
        calls.append(kwargs["num_decodes"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ca, "cascade_attention", counted)
    monkeypatch.setenv("LOOM_CASCADE_ATTN", mode)
    llm = LLM(model_dir, multiprocess=False, **options)
    try:
        # the prefix's blocks first, then every request hits them (one physical copy)
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], len(calls)


@needs_triton
def test_engine_greedy_equal_with_cascade_on_and_off(model_factory, monkeypatch):
    # 16 requests: a 24-token (3-block) shared prefix and 1-6 tokens of their own, 2 greedy tokens
    # (the first step's prompt chunks and a decode step run as cascade)
    model_dir = model_factory("qwen3", num_hidden_layers=1)   # (one layer: the interpreter is slow)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 250, 24).tolist()
    prompts = [shared + rng.integers(3, 250, 1 + i % 6).tolist() for i in range(16)]
    options = dict(attention_backend="triton", block_size=8, max_model_len=64, max_num_seqs=16)
    off, n_off = greedy_with_cascade(model_dir, prompts, "0", monkeypatch, 2, **options)
    on, n_on = greedy_with_cascade(model_dir, prompts, "force", monkeypatch, 2, **options)
    assert n_off == 0 and n_on > 0, (n_off, n_on)
    assert on == off


@needs_triton
def test_cascade_decode_graph_equals_plain_decode_graph(model_factory, monkeypatch):
    # the decode graphs' work uncaptured on the CPU (LOOM_DECODE_GRAPHS_ON_CPU=1), cascade graphs
    # from 8 rows: 12 requests (a size-16 graph, 4 padding rows) decode over a 24-token shared
    # prefix through the cascade graph's static inputs (the staged prefix length, row 0 of the
    # graph's table, fixed splits), and give the plain decode graph's greedy tokens
    from workers import decode_graphs
    from workers.decode_graphs import DecodeGraphs
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    monkeypatch.setattr(decode_graphs, "CASCADE_GRAPH_MIN_ROWS", 8)
    replays = []   # (size, rows, the staged prefix length of a cascade replay, else 0) of every model replay
    run_model = DecodeGraphs.run_model

    def recording(self, bs, rows, cascade=False):
        replays.append((bs, rows, int(self._dev_views[bs]["prefix_len"][0]) if cascade else 0))
        return run_model(self, bs, rows, cascade)
    monkeypatch.setattr(DecodeGraphs, "run_model", recording)
    model_dir = model_factory("qwen3", num_hidden_layers=1)
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 250, 24).tolist()
    prompts = [shared + rng.integers(3, 250, 1 + i % 5).tolist() for i in range(12)]
    # two graph sizes: the size-16 graph the 12 rows replay and the smallest cascade one (8); the
    # default 1, 2 and 4 would only be set up (each once, by the interpreter) and never replayed
    options = dict(attention_backend="triton", block_size=8, max_model_len=64, max_num_seqs=16,
                   cuda_graph_sizes=[8, 16])
    off, _ = greedy_with_cascade(model_dir, prompts, "0", monkeypatch, 4, **options)
    plain_replays, replays[:] = list(replays), []
    on, _ = greedy_with_cascade(model_dir, prompts, "force", monkeypatch, 4, **options)
    assert (16, 12, 24) in replays and not any(n for _, _, n in plain_replays), (replays, plain_replays)
    assert on == off


@needs_triton
def test_warm_up_compiles_the_variants_of_eager_cascade_steps(model_factory, monkeypatch):
    # the warm-up's cascade shapes, run dry (launches only submit their variants), reach every
    # kernel variant that eager cascade steps of other shapes pick: pure decodes of 8-64 rows,
    # with own keys short and long, and decodes with prompt chunks, over prefixes of 256-1,008 keys
    from triton.runtime.interpreter import InterpretedFunction

    from frontend import LLM
    from workers.compile_ahead import DryLaunches, ZeroedAllocations
    from workers.warmup import _cascade_once, _warmup_cascade
    variants: set = set()
    original = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):   # (the constexprs go by name)
        variants.add((self.fn.__name__, tuple(sorted(kwargs.items()))))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", recording)
    model_dir = model_factory("qwen3", num_hidden_layers=1, max_position_embeddings=2048)
    with LLM(model_dir, multiprocess=False, attention_backend="triton", max_model_len=2048, block_size=16,
             max_num_seqs=64, max_num_batched_tokens=2048) as llm:
        runner = llm.client.engine.executor.runner
        with DryLaunches().patched(InterpretedFunction), ZeroedAllocations(devices=("cpu",)):
            _warmup_cascade(runner)
            warmed, variants = set(variants), set()
            for rows in range(9, 65, 3):
                for prefix_len in (256, 496, 1008):
                    _cascade_once(runner, [1] * rows, prefix_len, 7)
                    _cascade_once(runner, [1] * rows, prefix_len, 700)
                    _cascade_once(runner, [1] * rows + [37, 64], prefix_len, 20)
    assert warmed and any(name == "_paged_attention_kernel" for name, _ in warmed)
    missed = variants - warmed
    assert not missed, "; ".join(str(dict(kw)) for _, kw in sorted(missed))


def test_planner_switches(model_factory, monkeypatch):
    # --disable-cascade-attn wins over LOOM_CASCADE_ATTN; the torch backend never plans; force
    # plans from one shared block (the heuristic would refuse this little), capped by the
    # tokens every request has computed
    from ipc.config import EngineConfig
    from workers.cascade_attn import CascadePlanner
    from workers.model_loader import load_model
    model_dir = model_factory("qwen3")
    model = load_model(model_dir, torch.float32, torch.device("cpu"), "dummy", False, "auto", None,
                       EngineConfig(model_dir))
    monkeypatch.setenv("LOOM_CASCADE_ATTN", "force")
    assert CascadePlanner.build(model, EngineConfig(model_dir, disable_cascade_attn=True), torch.float32, 8,
                                "triton") is None
    assert CascadePlanner.build(model, EngineConfig(model_dir), torch.float32, 8, "torch") is None
    planner = CascadePlanner.build(model, EngineConfig(model_dir), torch.float32, 8, "triton")
    bt = np.array([[4, 9, 2, 7], [4, 9, 2, 8], [4, 9, 2, 1]], dtype=np.int32)
    assert planner.prefix_len(bt, np.array([30, 24, 25]), np.ones(3, np.int64)) == 24
    assert planner.prefix_len(bt, np.array([30, 15, 25]), np.ones(3, np.int64)) == 8
    assert planner.prefix_len(bt, np.array([30, 7, 25]), np.ones(3, np.int64)) == 0
    monkeypatch.setenv("LOOM_CASCADE_ATTN", "auto")
    planner = CascadePlanner.build(model, EngineConfig(model_dir), torch.float32, 8, "triton")
    assert planner.prefix_len(bt, np.array([30, 24, 25]), np.ones(3, np.int64)) == 0
