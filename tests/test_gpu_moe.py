"""GPU: the Triton fused-MoE kernel (kernels/fused_moe.py) at Qwen3-30B-A3B's layer shape in
bf16 against its torch reference, inside CUDA graphs against eager, and the MoE models through
the engine (Triton path, decode and piecewise graphs) against HF and against eager."""
from __future__ import annotations

import pytest
import torch

from kernels import fused_moe as fm

pytestmark = pytest.mark.gpu

E, H, I, K = 128, 2048, 768, 8   # Qwen3-30B-A3B


def _layer(t: int, seed: int, bias: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, generator=g, **bf) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g, **bf) * I ** -0.5
    b13 = torch.randn(E, 2 * I, generator=g, **bf) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g, **bf) * 0.1 if bias else None
    hidden = torch.randn(t, H, generator=g, **bf)
    weights, ids = fm.select_experts(torch.randn(t, E, generator=g, device="cuda"), K, True)
    return hidden, w13, w2, b13, b2, weights, ids


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("t", [1, 7, 64, 300, 2048])
def test_kernel_matches_reference_at_qwen3_30b_shapes(t):
    """bf16: the kernel's error against an fp32 reference on the same bf16 values is within
    the bf16 reference's own (both round gate/up and the expert outputs to bf16), for the
    default config, the one the kernel picks (tuned where shipped) and a wide prefill tile."""
    hidden, w13, w2, _, _, weights, ids = _layer(t, seed=t)
    exact = fm.fused_moe_ref(hidden.float(), w13.float(), w2.float(), weights, ids)
    ref_err = _err(fm.fused_moe_ref(hidden, w13, w2, weights, ids), exact)
    wide = fm.MoeTileConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=16,
                            num_warps=8, num_stages=3)
    for cfg in (None, fm.default_config(t, E, K), wide):
        got = fm.fused_moe(hidden, w13, w2, weights, ids, config=cfg)
        assert got.dtype == torch.bfloat16 and got.shape == (t, H)
        assert _err(got, exact) <= 2 * ref_err + 2e-3, (cfg, _err(got, exact), ref_err)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_kernel_biases_and_activation_bf16(activation):
    hidden, w13, w2, b13, b2, weights, ids = _layer(33, seed=5, bias=True)
    kw = dict(w13_bias=b13, w2_bias=b2, activation=activation)
    exact = fm.fused_moe_ref(hidden.float(), w13.float(), w2.float(), weights, ids, w13_bias=b13.float(),
                             w2_bias=b2.float(), activation=activation)
    ref_err = _err(fm.fused_moe_ref(hidden, w13, w2, weights, ids, **kw), exact)
    assert _err(fm.fused_moe(hidden, w13, w2, weights, ids, **kw), exact) <= 2 * ref_err + 2e-3


@pytest.mark.parametrize("t", [8, 600])
def test_kernel_in_a_cuda_graph_equals_eager(t):
    """Captured once, replayed on new tokens and a new routing: bit-equal to an eager call. 8
    tokens align in the one-program Triton kernel, 600 (4800 pairs) in the three chunked ones."""
    hidden, w13, w2, _, _, weights, ids = _layer(t, seed=1)
    assert (t * K > fm.ALIGN_MAX_PAIRS_ONE_PROGRAM) == (t == 600)
    fm.fused_moe(hidden, w13, w2, weights, ids)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(hidden, w13, w2, weights, ids)
    new_hidden, _, _, _, _, new_weights, new_ids = _layer(t, seed=2)
    hidden.copy_(new_hidden)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fm.fused_moe(new_hidden, w13, w2, new_weights, new_ids))


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_gemv_path_matches_reference_at_qwen3_30b_shapes(t):
    """The small-batch GEMV path in bf16, its default tiles and every tile set bench/moe_decode.py
    times, within the bf16 reference's own error; ids of -1 (expert parallelism) add nothing."""
    from bench.moe_decode import VARIANTS
    hidden, w13, w2, _, _, weights, ids = _layer(t, seed=10 + t)
    ids[:, -1] = -1
    exact = fm.fused_moe_ref(hidden.float(), w13.float(), w2.float(), weights, ids)
    ref_err = _err(fm.fused_moe_ref(hidden, w13, w2, weights, ids), exact)
    for tiles in [None] + [fm.MoeGemvConfig.parse(v) for v in VARIANTS]:
        got = fm.fused_moe_gemv(hidden, w13, w2, weights, ids, config=tiles)
        assert got.dtype == torch.bfloat16 and got.shape == (t, H)
        assert _err(got, exact) <= 2 * ref_err + 2e-3, (tiles, _err(got, exact), ref_err)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_gemv_path_biases_and_activation_bf16(activation):
    hidden, w13, w2, b13, b2, weights, ids = _layer(3, seed=6, bias=True)
    kw = dict(w13_bias=b13, w2_bias=b2, activation=activation)
    exact = fm.fused_moe_ref(hidden.float(), w13.float(), w2.float(), weights, ids, w13_bias=b13.float(),
                             w2_bias=b2.float(), activation=activation)
    ref_err = _err(fm.fused_moe_ref(hidden, w13, w2, weights, ids, **kw), exact)
    assert _err(fm.fused_moe_gemv(hidden, w13, w2, weights, ids, **kw), exact) <= 2 * ref_err + 2e-3


@pytest.mark.parametrize("t", [1, 4])
def test_gemv_path_in_a_cuda_graph_equals_eager(t):
    """fused_moe dispatches to the GEMV path at t <= gemv_max_tokens(); captured, replayed on a
    new routing: bit-equal to eager (no atomics: the top-k sum is inside one program)."""
    assert t <= fm.gemv_max_tokens()
    hidden, w13, w2, _, _, weights, ids = _layer(t, seed=3)
    fm.fused_moe(hidden, w13, w2, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(hidden, w13, w2, weights, ids)
    new_hidden, _, _, _, _, new_weights, new_ids = _layer(t, seed=4)
    hidden.copy_(new_hidden)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    want = fm.fused_moe(new_hidden, w13, w2, new_weights, new_ids)
    assert torch.equal(out, want)
    assert torch.equal(want, fm.fused_moe_gemv(new_hidden, w13, w2, new_weights, new_ids))


def _hf_greedy(model_dir: str, prompts, n: int) -> list[list[int]]:
    """HF's greedy tokens on CUDA, up to n or through its first EOS."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out.append(hf.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
                       [0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_models_graphs_match_eager_and_hf(model_factory, arch, monkeypatch):
    """fp32 tiny MoE models on the GPU path (the Triton kernel, no --enforce-eager): decode and
    piecewise CUDA graphs give eager's greedy tokens, and both give HF's."""
    from frontend import LLM, SamplingParams
    monkeypatch.setenv("LOOM_STEP_STATS", "1")
    model_dir = model_factory(arch)
    prompts = [list(range(11, 51)), [50, 60, 70], list(range(100, 130)), list(range(7, 97))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    res, stats = {}, {}
    for eager in (True, False):
        llm = LLM(model_dir, max_model_len=256, dtype="float32", max_num_batched_tokens=64, max_num_seqs=16,
                  enforce_eager=eager)
        try:
            res[eager] = [o.outputs[0].token_ids for o in
                          llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            stats[eager] = llm.collective_rpc("step_stats")[0]
        finally:
            llm.shutdown()
    assert "eager" not in stats[False], stats[False]
    assert res[False] == res[True]
    for ours, hf in zip(res[True], _hf_greedy(model_dir, prompts, 24)):
        assert ours[:len(hf)] == hf   # HF stops at EOS; ours (ignore_eos) runs on past it
