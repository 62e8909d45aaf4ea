"""--kv-cache-dtype fp8 (issue 46, item 4): the FP8 KV cache's write and read paths against
their torch references (Triton under TRITON_INTERPRET=1 on CPU, on the GPU at real shapes in
tests/test_gpu_kv_fp8.py), and the engine with an FP8 cache: twice the blocks, the demo model's
greedy output unchanged, prefix caching and chunked prefill, checkpoint and calculated scales."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import kv_quant
from tests import test_kernels as tk

FP8 = torch.float8_e4m3fn
_ROOT = Path(__file__).resolve().parents[1]
kvw = tk._load_private("kv_cache_write") if tk.MODE == "interpret" else __import__("kernels.kv_cache_write").kv_cache_write


@pytest.fixture
def triton_mode(monkeypatch):
    if tk.MODE == "subprocess":
        pytest.skip("triton was imported without TRITON_INTERPRET=1; see test_kernels_in_fresh_interpreter")
    if tk.MODE == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_kernels_in_fresh_interpreter():
    if tk.MODE != "subprocess":
        pytest.skip("the kernels run in this process")
    assert not os.environ.get("_LOOM_KERNEL_TESTS_CHILD")
    env = dict(os.environ, TRITON_INTERPRET="1", _LOOM_KERNEL_TESTS_CHILD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "kernel",
                           str(Path(__file__))], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def _scale(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32, device=tk.DEVICE)


def _quantized_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, seed, k_scale, v_scale):
    """A batch whose caches hold FP8 codes of values up to a few times the scale's range."""
    q, kc, vc, qsl, sl, bt = tk._make_batch(q_lens, seq_lens, hq, hkv, d, bs, torch.float32, seed)
    kc8 = kv_quant.quantize_fp8_ref(torch.nan_to_num(kc) * 300 * float(k_scale), k_scale)
    vc8 = kv_quant.quantize_fp8_ref(torch.nan_to_num(vc) * 300 * float(v_scale), v_scale)
    return q.to(dtype), kc8, vc8, qsl, sl, bt


def test_quantize_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -3.0, 1e6, -1e6, 448.0 * 2 + 1])
    codes = kv_quant.quantize_fp8_ref(x, torch.tensor([2.0]))
    assert codes.dtype == FP8 and not codes.float().isnan().any()
    assert codes.float().tolist() == [0.0, 0.5, -1.5, 448.0, -448.0, 448.0]
    assert kv_quant.dequantize_ref(codes, torch.tensor([2.0])).tolist() == [0.0, 1.0, -3.0, 896.0, -896.0, 896.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_fp8_kernel_matches_ref(triton_mode, dtype):
    """Prefill, chunked prefill over a cached prefix, and decodes (split-KV too), GQA 2."""
    q_lens, seq_lens = [5, 1, 1, 9, 1], [5, 23, 40, 30, 7]
    k_scale, v_scale = _scale(0.02), _scale(0.005)
    q, kc, vc, qsl, sl, bt = _quantized_batch(q_lens, seq_lens, 4, 2, 32, 4, dtype, 3, k_scale, v_scale)
    ref = tk.pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 32 ** -0.5, k_scale=k_scale, v_scale=v_scale).float()
    # the reference is the dequantized cache's attention, in fp32
    dense = tk.pa.paged_attention_ref(q.float(), kc.float() * 0.02, vc.float() * 0.005, qsl, sl, bt, 32 ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ref, dense, atol=tol * dense.abs().max().item(), rtol=0)
    for splits in (1, 2):
        out = tk.pa.paged_attention(q, kc, vc, qsl, sl, bt, 32 ** -0.5, max(q_lens), max(seq_lens),
                                    num_kv_splits=splits, k_scale=k_scale, v_scale=v_scale)
        assert out.dtype == dtype
        err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
        assert err < tol, f"splits={splits}: relative max error {err}"
    # the scales matter: without them the same codes give another output
    wrong = tk.pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 32 ** -0.5).float()
    assert (wrong - ref).abs().max().item() > 10 * tol * ref.abs().max().item()


def test_attention_fp8_sdpa_cpu_path_matches_ref():
    from kernels.sdpa_attention import paged_attention_sdpa
    q_lens, seq_lens = [5, 1, 1, 9, 1], [5, 23, 40, 30, 7]
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.005])
    q, kc, vc, qsl, sl, bt = _quantized_batch(q_lens, seq_lens, 4, 2, 32, 4, torch.float32, 4, k_scale, v_scale)
    q, kc, vc, qsl, sl, bt = (t.cpu() for t in (q, kc, vc, qsl, sl, bt))
    ref = tk.pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 32 ** -0.5, k_scale=k_scale, v_scale=v_scale)
    out = paged_attention_sdpa(q, kc, vc, qsl, sl, bt, 32 ** -0.5, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def _same_codes(out: torch.Tensor, ref: torch.Tensor, steps: int = 1) -> bool:
    """The kernel's e4m3 codes are the reference's. Triton's interpreter (3.9) converts fp32 to
    e4m3 its own way: it drops the carry when rounding overflows the mantissa (7.85 becomes 4,
    not 8), and rounds ties away from zero and subnormals loosely. The GPU rounds right
    (tests/test_gpu_kv_fp8.py asks for exact codes); here a code may be half the reference's
    power of two, or one e4m3 step from it."""
    differ = out.view(torch.uint8) != ref.view(torch.uint8)
    if tk.MODE == "cuda" and steps == 1 or not differ.any():
        return not differ.any()
    o, r = out.float()[differ], ref.float()[differ]
    lost_carry = (o * 2 == r) & (torch.frexp(r).mantissa.abs() == 0.5)
    step = torch.exp2(torch.frexp(r).exponent.float() - 4).clamp_min(2 ** -9)
    return bool((lost_carry | ((o - r).abs() <= steps * step)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_fp8_kernel_matches_ref(triton_mode, dtype):
    g = tk._gen(8)
    T, hkv, d, bs, nb = 9, 2, 32, 4, 6
    k, v = tk._randn(T, hkv, d, dtype=dtype, g=g, scale=20.0), tk._randn(T, hkv, d, dtype=dtype, g=g, scale=5.0)
    k[0, 0, 0] = 1e5   # saturates
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[2, 6]] = -1
    slots = slots.to(tk.DEVICE)
    caches = [torch.zeros(nb, bs, hkv, d, dtype=FP8, device=tk.DEVICE) for _ in range(4)]
    k_scale, v_scale = _scale(0.05), _scale(0.02)
    kvw.write_kv_cache(k, v, caches[0], caches[1], slots, k_scale, v_scale)
    tk.pa.write_kv_cache_ref(k, v, caches[2], caches[3], slots, k_scale, v_scale)
    assert _same_codes(caches[0], caches[2]) and _same_codes(caches[1], caches[3])
    assert caches[0].float().abs().max() == 448.0 and not caches[0].float().isnan().any()
    written = caches[2].view(-1, hkv, d)[slots[slots >= 0].long()].float() * 0.05
    torch.testing.assert_close(written, k[slots >= 0].float().clamp(-448 * 0.05, 448 * 0.05), rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("dtype,norm,neox", [(torch.float32, True, True), (torch.bfloat16, True, True),
                                             (torch.bfloat16, False, False)])
def test_qk_norm_rope_cache_fp8_kernel_matches_ref(triton_mode, dtype, norm, neox):
    g = tk._gen(9)
    T, hq, hkv, d, bs, nb = 7, 6, 2, 32, 4, 6
    cache = tk.rot.build_rope_cache(d, 64, 10000.0, None).to(tk.DEVICE)
    qkv = tk._randn(T, (hq + 2 * hkv) * d, dtype=dtype, g=g, scale=4.0)
    q, k, v = (qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d),
               qkv[:, (hq + hkv) * d:].view(T, hkv, d))
    pos = torch.randint(0, 64, (T,), generator=g).to(tk.DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[3] = -1
    slots = slots.to(tk.DEVICE)
    qw, kw = (tk._randn(d, dtype=dtype, g=g), tk._randn(d, dtype=dtype, g=g)) if norm else (None, None)
    caches = [torch.zeros(nb, bs, hkv, d, dtype=FP8, device=tk.DEVICE) for _ in range(4)]
    k_scale, v_scale = _scale(0.03), _scale(0.01)
    out = tk.qrc.qk_norm_rope_cache(pos, q, k, v, cache, caches[0], caches[1], slots, qw, kw, 1e-6,
                                    is_neox_style=neox, k_scale=k_scale, v_scale=v_scale)
    ref = tk.qrc.qk_norm_rope_cache_ref(pos, q, k, v, cache, caches[2], caches[3], slots, qw, kw, 1e-6,
                                        is_neox_style=neox, k_scale=k_scale, v_scale=v_scale)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tk.BF16_TOL
    torch.testing.assert_close(out, ref, **tol)
    assert _same_codes(caches[1], caches[3])   # values: no arithmetic before the division
    if dtype == torch.float32:
        assert _same_codes(caches[0], caches[2])
    else:  # the interpreter's fp32 -> bf16 rounding may differ by an ulp: a code more apart at most
        assert _same_codes(caches[0], caches[2], steps=2)


# --------------------------------------------------------------------------
# the engine with an FP8 cache (in-process LLM, the CPU's SDPA path)
# --------------------------------------------------------------------------
def _greedy(llm, prompts, n: int) -> list[list[int]]:
    from frontend import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _runner(llm):
    return llm.client.engine.executor.runner


def _attention_layers(model):
    from workers.attention import Attention
    return [m for m in model.modules() if isinstance(m, Attention)]


ZEN = ["Beautiful is better than", "Errors should", "There should be one--", "Now is better than"]


def test_demo_model_greedy_fp8_equals_full_precision(demo_model_dir):
    """The issue's proof: FP8 KV keeps the demo model's greedy output for 32 tokens, with the
    scales at 1.0 and with --calculate-kv-scales (from the first batch)."""
    from frontend import LLM
    common = dict(multiprocess=False, max_model_len=128, max_num_seqs=4, block_size=8)
    with LLM(demo_model_dir, **common) as llm:
        want = _greedy(llm, ZEN, 32)
    for extra in ({}, {"calculate_kv_scales": True}):
        with LLM(demo_model_dir, kv_cache_dtype="fp8", **common, **extra) as llm:
            runner = _runner(llm)
            assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in runner.kv_caches)
            assert _greedy(llm, ZEN, 32) == want, extra
            scales = [float(a.k_scale) for a in _attention_layers(runner.model)]
            if extra:   # calculated: the first batch's amax over 200, one per layer
                assert all(s != 1.0 and s > 0 for s in scales) and len(set(scales)) == len(scales)
            else:
                assert scales == [1.0] * len(scales)


def test_fp8_doubles_the_blocks_and_reports_its_dtype(model_factory):
    from prometheus_client import CollectorRegistry

    from frontend import LLM
    from metrics.registry import Builder
    from metrics.stat_logger import PrometheusStatLogger
    model = model_factory("qwen3")
    blocks = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        with LLM(model, multiprocess=False, dtype="bfloat16", kv_cache_dtype=kv_dtype, max_model_len=64,
                 block_size=4, kv_cache_memory_bytes=1 << 20) as llm:
            blocks[kv_dtype] = llm.num_gpu_blocks
            info = PrometheusStatLogger(llm.config, 0, llm.num_gpu_blocks,
                                        builder=Builder(CollectorRegistry()))._cache_info()
            assert info["cache_dtype"] == kv_dtype and info["num_gpu_blocks"] == str(llm.num_gpu_blocks)
            assert _greedy(llm, [{"prompt_token_ids": [5, 6, 7]}], 4)[0]
    assert blocks["fp8_e4m3"] == 2 * blocks["auto"]


def test_fp8_prefix_caching_and_chunked_prefill(model_factory):
    """Prompts sharing a prefix, their prefill chunked 8 tokens at a time and the prefix's blocks
    reused, give what one unchunked, uncached prefill over the same FP8 cache gives."""
    from frontend import LLM
    model = model_factory("qwen3")
    prefix = list(range(3, 43))
    prompts = [{"prompt_token_ids": prefix + [50 + i, 60 + i, 70 + i]} for i in range(3)]
    common = dict(multiprocess=False, kv_cache_dtype="fp8", max_model_len=96, block_size=4, max_num_seqs=4)
    with LLM(model, enable_prefix_caching=False, **common) as llm:
        want = _greedy(llm, prompts, 8)
    with LLM(model, enable_prefix_caching=True, max_num_batched_tokens=8, **common) as llm:
        first = _greedy(llm, prompts[:1], 8)
        rest = _greedy(llm, prompts[1:], 8)
        assert llm.stats.prefix_cache_hits >= 2 * 40 // 4 * 4   # the 40-token prefix, in whole blocks
    assert first + rest == want


def test_checkpoint_kv_scales_are_loaded(model_factory, tmp_path):
    """vLLM's names for a checkpoint's scales land on the layers' k_scale / v_scale; a query scale
    is dropped; an unknown tensor still fails the load."""
    import shutil

    from safetensors.torch import load_file, save_file

    from workers.model_loader import load_model
    src = Path(model_factory("qwen3"))
    dst = tmp_path / "scaled"
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    tensors = load_file(files[0])
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
                    "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
                    "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125]),
                    "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.0625, 0.03]),
                    "model.layers.1.self_attn.q_proj.output_scale": torch.tensor([3.0])})
    save_file(tensors, files[0], metadata={"format": "pt"})
    model = load_model(str(dst), torch.float32, "cpu")
    layers = _attention_layers(model)
    assert [(float(a.k_scale), float(a.v_scale)) for a in layers[:2]] == [(0.25, 0.5), (0.125, 0.0625)]
    assert all(float(a.k_scale) == 1.0 for a in layers[2:])
    tensors["model.layers.0.self_attn.kv_scale"] = torch.tensor(2.0)
    tensors.pop("model.layers.0.self_attn.k_scale")
    tensors["model.layers.0.self_attn.unknown_scale_thing"] = torch.tensor(2.0)
    save_file(tensors, files[0], metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unknown_scale_thing"):
        load_model(str(dst), torch.float32, "cpu")


def test_fp8_decode_graph_path_calculated_scales_and_sleep_wake(model_factory, monkeypatch):
    """The decode graphs' path (run uncaptured on the CPU) over an FP8 cache with calculated
    scales gives the eager engine's tokens; the first step calculates the scales, later ones keep
    them; sleep (levels 1 and 2) and wake-up reallocate the FP8 cache and keep the scales."""
    from frontend import LLM
    model = model_factory("qwen3")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 30)]
    opts = dict(multiprocess=False, kv_cache_dtype="fp8", calculate_kv_scales=True, max_model_len=64,
                block_size=4, max_num_seqs=4, enable_sleep_mode=True)
    with LLM(model, enforce_eager=True, **opts) as llm:
        want = _greedy(llm, prompts, 8)
        eager_scales = [float(a.k_scale) for a in _attention_layers(_runner(llm).model)]
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    with LLM(model, **opts) as llm:
        runner = _runner(llm)
        assert runner.decode_graphs is not None
        assert _greedy(llm, prompts, 8) == want
        scales = [float(a.k_scale) for a in _attention_layers(runner.model)]
        assert scales == eager_scales and all(s != 1.0 for s in scales)
        assert _greedy(llm, prompts[:1], 8) == want[:1]   # a later first step does not recalculate
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up()
            assert all(k.dtype == FP8 for k, _ in runner.kv_caches)
            assert [float(a.k_scale) for a in _attention_layers(runner.model)] == scales
            assert _greedy(llm, prompts, 8) == want


def test_mfu_counts_fp8_kv_bytes():
    """--enable-mfu-metrics: an FP8 cache's reads and writes are one byte an element."""
    from metrics.mfu import MfuEstimator, ModelShape
    shape = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=10, dtype_bytes=2)
    bf16 = MfuEstimator(shape).step(3, 6, 3, 1)
    fp8 = MfuEstimator(ModelShape(**{**shape.__dict__, "kv_dtype_bytes": 1})).step(3, 6, 3, 1)
    kv = 2 * 2 * 1 * 4 * 3   # layers x (k, v) x heads x head size x tokens
    assert bf16.write_bytes == 2 * kv and fp8.write_bytes == kv
    assert bf16.read_bytes - fp8.read_bytes == kv and fp8.flops == bf16.flops


@pytest.mark.slow   # three processes: ~10 s on an idle 2-core box
def test_fp8_tensor_parallel_equals_one_rank(model_factory):
    """TP=2 (two gloo worker processes, one KV head each) over FP8 caches gives TP=1's tokens."""
    from frontend import LLM
    model = model_factory("qwen3")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (6, 19)]
    opts = dict(kv_cache_dtype="fp8", max_model_len=64, block_size=4, max_num_seqs=2)
    with LLM(model, multiprocess=False, **opts) as llm:
        want = _greedy(llm, prompts, 8)
    with LLM(model, tensor_parallel_size=2, **opts) as llm:
        assert _greedy(llm, prompts, 8) == want


def test_fp8_generic_path_equals_native(model_factory):
    """The generic transformers path writes the FP8 cache through kernels/kv_cache_write.py's
    reference and calculates its scales from the HF module's rotated keys: the native path's tokens."""
    from frontend import LLM
    model = model_factory("llama")
    prompts = [{"prompt_token_ids": list(range(3, 20))}, {"prompt_token_ids": [5, 6]}]
    outs = []
    for impl in ("loom", "transformers"):
        with LLM(model, multiprocess=False, model_impl=impl, kv_cache_dtype="fp8", calculate_kv_scales=True,
                 max_model_len=64, block_size=4) as llm:
            outs.append(_greedy(llm, prompts, 8))
            assert all(float(a.k_scale) != 1.0 for a in _attention_layers(_runner(llm).model))
    assert outs[0] == outs[1]
