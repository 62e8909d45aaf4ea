"""GPU-only checks (run on the H200 through the device tool): bf16 parity with HF,
CUDA graphs against eager, and sleep releasing device memory."""
from __future__ import annotations

import time

import pytest
import torch

from frontend import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [50, 60, 70], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def bf16_model(model_factory):
    return model_factory("llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=4)


def _hf_greedy_cuda(model_dir: str, dtype, prompts, n: int, stop_at_eos: bool = False) -> list[list[int]]:
    """HF's greedy tokens on CUDA: n of them (EOS suppressed, for engines run with ignore_eos),
    or up to the first EOS (`stop_at_eos`: compare with an engine that stops there; suppressing
    EOS changes the argmax wherever EOS would have won)."""
    from transformers import AutoModelForCausalLM
    # eager attention: the exact reference whatever the transformers version's default (an SDPA
    # default drops Gemma 2's attention soft cap, which HF's eager path and Loom apply)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").cuda().eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            least = {} if stop_at_eos else {"min_new_tokens": n}
            out.append(hf.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                                   **least)[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    return out


def test_fp32_triton_engine_matches_hf_exactly(bf16_model):
    """fp32 on the GPU: the Triton kernels and CUDA graphs must reproduce HF's greedy tokens."""
    ref = _hf_greedy_cuda(bf16_model, torch.float32, PROMPTS, 48)
    llm = LLM(bf16_model, max_model_len=256, dtype="float32")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_bf16_parity_with_hf_on_demo_model(demo_model_dir):
    """bf16 on a trained model (confident predictions): the Zen comes out as HF's does."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    prompts = [tok.encode(t) for t in ("Beautiful is better than", "Errors should never", "Now is better")]
    ref = _hf_greedy_cuda(demo_model_dir, torch.bfloat16, prompts, 64)
    llm = LLM(demo_model_dir, max_model_len=512)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for o, r in zip(outs, ref):
        d = _first_divergence(o.outputs[0].token_ids, r)
        print(f"bf16 demo model: first divergence at {d} of 64")
        assert d >= 32, f"bf16 output diverges from HF at token {d}"


def test_cuda_graphs_match_eager(bf16_model):
    res = {}
    for eager in (True, False):
        llm = LLM(bf16_model, max_model_len=256, enforce_eager=eager)
        try:
            res[eager] = [o.outputs[0].token_ids for o in
                          llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
        finally:
            llm.shutdown()
    for a, b in zip(res[True], res[False]):
        assert _first_divergence(a, b) >= 24


def test_cuda_graph_sampling_matches_eager(bf16_model):
    """Seeded sampling in fp32: the decode graphs' head (temperature, min-p), and the eager
    sampler after a graph (a batch with top-k / top-p rows), draw what eager steps draw."""
    plain = [SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True),
             SamplingParams(temperature=1.0, min_p=0.05, seed=8, max_tokens=32, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]
    mixed = plain[:2] + [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=9, max_tokens=32,
                                        ignore_eos=True)]
    res = {}
    for eager in (True, False):
        llm = LLM(bf16_model, max_model_len=256, dtype="float32", enforce_eager=eager)
        try:
            res[eager] = [o.outputs[0].token_ids for params in (plain, mixed) for o in
                          llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        finally:
            llm.shutdown()
    for a, b in zip(res[True], res[False]):
        assert _first_divergence(a, b) >= 24, (a, b)


def test_piecewise_graphs_match_eager(bf16_model, monkeypatch):
    """Prefills, prompt chunks and decodes mixed with them run as piecewise CUDA graphs (the
    token count padded to a captured size, attention between the pieces): in fp32 the same
    tokens as eager, with no step left eager."""
    monkeypatch.setenv("LOOM_STEP_STATS", "1")
    prompts = [list(range(7 + i, 7 + i + n)) for i, n in enumerate([5, 37, 90, 130, 17, 260, 3, 64])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    res, stats = {}, {}
    for eager in (True, False):
        llm = LLM(bf16_model, max_model_len=512, dtype="float32", max_num_batched_tokens=200, max_num_seqs=64,
                  enforce_eager=eager)
        try:
            res[eager] = [o.outputs[0].token_ids for o in
                          llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            stats[eager] = llm.collective_rpc("step_stats")[0]
        finally:
            llm.shutdown()
    print(f"piecewise graphs: {stats[False]}")
    assert stats[False]["piecewise"]["steps"] >= 3 and "eager" not in stats[False]
    assert "piecewise" not in stats[True]
    assert res[False] == res[True]


def test_generic_path_graphs_match_eager_and_native(bf16_model, monkeypatch):
    """The generic transformers path (--model-impl transformers) under the decode and piecewise
    CUDA graphs: in fp32 the native path's tokens, and its graphs the eager steps' tokens."""
    monkeypatch.setenv("LOOM_STEP_STATS", "1")
    prompts = [list(range(7 + i, 7 + i + n)) for i, n in enumerate([5, 37, 90, 130, 17, 3])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    res, stats = {}, {}
    for impl, eager in (("transformers", True), ("transformers", False), ("loom", False)):
        llm = LLM(bf16_model, max_model_len=512, dtype="float32", max_num_batched_tokens=200, max_num_seqs=64,
                  enforce_eager=eager, model_impl=impl)
        try:
            res[impl, eager] = [o.outputs[0].token_ids for o in
                                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            stats[impl, eager] = llm.collective_rpc("step_stats")[0]
        finally:
            llm.shutdown()
    print(f"generic path graphs: {stats['transformers', False]}")
    assert stats["transformers", False]["piecewise"]["steps"] >= 2 and "eager" not in stats["transformers", False]
    assert res["transformers", False] == res["transformers", True]
    for a, b in zip(res["transformers", False], res["loom", False]):
        assert _first_divergence(a, b) >= 16, (a, b)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "cohere2", "glm4", "stablelm", "granite", "gpt_neox"])
def test_fp32_triton_new_architectures_match_hf(model_factory, name):
    """Issue 44's architectures on the GPU path (Triton kernels, decode and piecewise CUDA graphs),
    fp32: sliding windows shorter than the prompts, soft caps, GeGLU, GPT-J and partial rotary,
    LayerNorms, the generic path. Greedy tokens equal HF's on CUDA."""
    from tests.tiny_models import ARCHS
    model_dir = model_factory(name)
    prompts = [list(range(11, 51)), [50, 60, 70], list(range(100, 130))]
    ref = _hf_greedy_cuda(model_dir, torch.float32, prompts, 32, stop_at_eos=True)
    impl = {"model_impl": "transformers"} if ARCHS[name].path == "transformers" else {}
    llm = LLM(model_dir, max_model_len=256, dtype="float32", **impl)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_device_memory(bf16_model, level):
    llm = LLM(bf16_model, max_model_len=256, enable_sleep_mode=True, gpu_memory_utilization=0.3)
    try:
        before = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                               GREEDY, use_tqdm=False)]
        awake = llm.collective_rpc("memory_info")[0]
        t0 = time.perf_counter()
        llm.sleep(level)
        t_sleep = time.perf_counter() - t0
        asleep = llm.collective_rpc("memory_info")[0]
        t0 = time.perf_counter()
        llm.wake_up()
        t_wake = time.perf_counter() - t0
        after = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                              GREEDY, use_tqdm=False)]
        print(f"level {level}: reserved awake {awake['reserved'] / 2**30:.2f} GiB, asleep "
              f"{asleep['reserved'] / 2**30:.3f} GiB; device used {awake['device_used'] / 2**30:.2f} -> "
              f"{asleep['device_used'] / 2**30:.2f} GiB; sleep {t_sleep:.2f}s, wake {t_wake:.2f}s")
        assert asleep["reserved"] < 0.1 * awake["reserved"]
        assert asleep["device_used"] < 0.1 * awake["device_used"]
        assert after == before
    finally:
        llm.shutdown()
