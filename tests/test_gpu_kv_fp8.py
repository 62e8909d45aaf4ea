"""GPU-only checks of the FP8 KV cache (issue 46): the kernels against their references at
Qwen3-0.6B's shapes, attention accuracy and needle retrieval at 32k keys (bench/needle.py), and
the engine with an FP8 cache: CUDA graphs (the scales are device tensors the graphs read),
--calculate-kv-scales, sleep/wake, the demo model's greedy output.

    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kv_fp8.py
"""
from __future__ import annotations

import pytest
import torch

from bench import needle
from kernels import kv_cache_write, kv_quant, paged_attention as pa, qk_rope_cache as qrc, rotary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FP8 = kv_quant.FP8_DTYPE
BF16 = torch.bfloat16
HQ, HKV, D, BS = 16, 8, 128, 16   # Qwen3-0.6B


def _scale(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32, device="cuda")


def _codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("tokens", [1, 7, 2048])
def test_fp8_cache_writes_match_reference_exactly(tokens):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    nb = 4 * tokens // BS + 8
    slots = torch.randperm(nb * BS, generator=g, device="cuda")[:tokens]
    if tokens > 1:
        slots[1] = -1
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=g, device="cuda").mul_(3).to(BF16)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(tokens, HQ, D), k.view(tokens, HKV, D), v.view(tokens, HKV, D)
    cos_sin = rotary.build_rope_cache(D, 40960, 1e6, None).cuda()
    pos = torch.randint(0, 40960, (tokens,), generator=g, device="cuda")
    qw, kw = torch.randn(D, device="cuda").to(BF16), torch.randn(D, device="cuda").to(BF16)
    ks, vs = _scale(0.021), _scale(0.013)
    caches = [torch.zeros(nb, BS, HKV, D, dtype=FP8, device="cuda") for _ in range(4)]
    out = qrc.qk_norm_rope_cache(pos, q, k, v, cos_sin, caches[0], caches[1], slots, qw, kw, 1e-6,
                                 k_scale=ks, v_scale=vs)
    ref = qrc.qk_norm_rope_cache_ref(pos, q, k, v, cos_sin, caches[2], caches[3], slots, qw, kw, 1e-6,
                                     k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)
    assert _codes_equal(caches[1], caches[3])
    # keys: the kernel's bf16 rounding of the rotation may differ from torch's by an ulp, which
    # can move a code by one step; the rest are exact
    diff = caches[0].float() != caches[2].float()
    assert diff.float().mean() < 1e-3
    for c in caches:
        c.zero_()
    kv_cache_write.write_kv_cache(k, v, caches[0], caches[1], slots, ks, vs)
    pa.write_kv_cache_ref(k, v, caches[2], caches[3], slots, ks, vs)
    assert _codes_equal(caches[0], caches[2]) and _codes_equal(caches[1], caches[3])


@pytest.mark.parametrize("case", ["prefill", "chunk", "decode"])
def test_fp8_attention_matches_reference_at_real_shapes(case):
    g = torch.Generator(device="cuda").manual_seed(3)
    q_lens, seq_lens = {"prefill": ([2048, 512], [2048, 512]), "chunk": ([1, 1, 300], [1500, 3000, 4000]),
                        "decode": ([1] * 64, torch.randint(100, 4096, (64,), generator=g).tolist())}[case]
    nb = sum(-(-s // BS) for s in seq_lens) + 4
    ks, vs = _scale(0.05), _scale(0.02)
    kc = kv_quant.quantize_fp8_ref(torch.randn(nb, BS, HKV, D, generator=g, device="cuda") * 5, ks)
    vc = kv_quant.quantize_fp8_ref(torch.randn(nb, BS, HKV, D, generator=g, device="cuda"), vs)
    perm = torch.randperm(nb, generator=g, device="cuda").to(torch.int32)
    width = max(-(-s // BS) for s in seq_lens)
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
    i = 0
    for r, s in enumerate(seq_lens):
        n = -(-s // BS)
        bt[r, :n] = perm[i:i + n]
        i += n
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(int(qsl[-1]), HQ, D, generator=g, device="cuda").to(BF16)
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, D ** -0.5, k_scale=ks, v_scale=vs).float()
    nd = 2 if case == "chunk" else 0   # the mixed batch's decodes first: two launches
    for splits in (None, 1, 4):
        out = pa.paged_attention(q, kc, vc, qsl, sl, bt, D ** -0.5, max(q_lens), max(seq_lens),
                                 num_kv_splits=splits, num_decodes=nd, k_scale=ks, v_scale=vs).float()
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{case} splits={splits}: relative error {err}"


def test_fp8_attention_accuracy_and_needle_at_32k():
    """bench/needle.py at 32,768 keys: FP8's output error against fp32 stays at e4m3's rounding
    (a few %: no accumulation loss, split or not), and its needle retrieval is within 2 points
    of the bf16 cache's."""
    errors = needle.output_errors(32768, torch.device("cuda"))
    print(errors)
    for name, e in errors.items():
        assert e < (0.01 if name.startswith("bf16") else 0.08), (name, e)
    # split-KV changes nothing but the order of the sums
    for kind in ("decode", "chunk"):
        pair = [e for n, e in errors.items() if n.startswith(f"fp8 {kind}")]
        assert max(pair) - min(pair) < 2e-3, pair
    scores = needle.needle_scores(32768, 24, torch.device("cuda"))
    print(scores)
    assert 10.0 < scores["fp32"] < 95.0   # graded: neither all lost nor all found
    assert abs(scores["bf16"] - scores["fp32"]) <= 2.0 and scores["bf16"] - scores["fp8"] <= 2.0


# ------------------------------------------------------------ the engine with an FP8 cache

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [50, 60, 70], list(range(100, 400))]


def _greedy(llm, prompts, n=32):
    from frontend import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def gpu_model(model_factory):
    return model_factory("qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=4, head_dim=64)


@pytest.mark.parametrize("calculate", [False, True])
def test_fp8_cuda_graphs_equal_eager_and_sleep_wake(gpu_model, calculate):
    """The decode and piecewise graphs read the scales as tensors: graphs and eager give the same
    tokens, with --calculate-kv-scales too (its first step eager, the graphs after it); sleep and
    wake-up reallocate the FP8 cache and keep the scales."""
    from frontend import LLM
    opts = dict(max_model_len=512, kv_cache_dtype="fp8", calculate_kv_scales=calculate, dtype="bfloat16")
    with LLM(gpu_model, enforce_eager=True, **opts) as llm:
        eager = _greedy(llm, PROMPTS)
    with LLM(gpu_model, enable_sleep_mode=True, **opts) as llm:
        assert _greedy(llm, PROMPTS) == eager
        llm.sleep(level=1)
        llm.wake_up()
        assert _greedy(llm, PROMPTS) == eager


def test_fp8_demo_model_greedy_equals_bf16(demo_model_dir):
    from transformers import AutoTokenizer

    from frontend import LLM
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    prompts = [tok.encode(t) for t in ("Beautiful is better than", "Errors should never", "Now is better")]
    with LLM(demo_model_dir, max_model_len=256, dtype="bfloat16") as llm:
        want = _greedy(llm, prompts)
    with LLM(demo_model_dir, max_model_len=256, dtype="bfloat16", kv_cache_dtype="fp8",
             calculate_kv_scales=True) as llm:
        assert _greedy(llm, prompts) == want
        assert llm.num_gpu_blocks > 0
