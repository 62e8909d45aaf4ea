"""Triton kernels vs their torch references.

Without CUDA the kernels run under the Triton interpreter on CPU tensors.
Triton decides interpreter-or-compiler when a function is *decorated*: for our
kernels, and for triton.language's own jit'd helpers (tl.sum, ...) when triton
is first imported. So this module:

* with CUDA: imports kernels.* and runs everything on the GPU;
* without CUDA: sets TRITON_INTERPRET=1 only while it loads private copies of
  the kernel modules (the shared kernels.* modules other tests import keep
  falling back to the torch refs on CPU), and during each of its tests;
* if triton was already imported (by an earlier test module or conftest)
  without TRITON_INTERPRET=1, the interpreter cannot run in this process: the
  tests here are skipped and test_in_fresh_interpreter reruns this file in a
  subprocess with TRITON_INTERPRET=1. (Setting TRITON_INTERPRET=1 in
  tests/conftest.py before anything imports triton avoids that detour.)
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
_ROOT = Path(__file__).resolve().parents[1]
_KERNELS = {
    "paged_attention": ["_paged_attention_kernel", "_split_kv_reduce_kernel"],
    "rms_norm": ["_rms_norm_kernel"],
    "rotary": [],
    "activation": ["_act_and_mul_kernel"],
    "sampling": ["_sample_kernel"],
    "qk_rope_cache": ["_qk_norm_rope_cache_kernel"],
    "penalties": ["_penalties_kernel"],
    "gemv": ["_gemv_kernel"],
    "skinny_gemm": ["_skinny_gemm_kernel"],
    "allreduce_norm": ["_allreduce_add_rms_norm_kernel", "_lamport_add_rms_norm_kernel"],
    "decode_inputs": ["_decode_inputs_kernel"],
    "embedding": ["_vocab_parallel_embedding_kernel"],
    "all_gather": ["_all_gather_kernel"],
    "rotary_apply": ["_apply_rotary_kernel"],
}


def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def _load_private(name: str):
    """kernels/<name>.py as a separate module object, decorated now."""
    spec = importlib.util.spec_from_file_location(f"_loom_test_kernels_{name}", _ROOT / "kernels" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


if HAS_CUDA and os.environ.get("TRITON_INTERPRET", "0") != "1":
    MODE = "cuda"
    _mods = {name: importlib.import_module(f"kernels.{name}") for name in _KERNELS}
else:
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as _tl

        if _interpreted(_tl.sum):
            MODE = "interpret"
            _mods = {name: _load_private(name) for name in _KERNELS}
        else:
            MODE = "subprocess"
            _mods = {name: importlib.import_module(f"kernels.{name}") for name in _KERNELS}
    finally:
        if _prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _prev

INTERPRET = MODE != "cuda"
DEVICE = "cuda" if MODE == "cuda" else "cpu"
pa, rn, rot, act, smp, qrc, pen, gv, arn, dec, emb, ag = (
    _mods[n] for n in ("paged_attention", "rms_norm", "rotary", "activation", "sampling", "qk_rope_cache",
                       "penalties", "gemv", "allreduce_norm", "decode_inputs", "embedding", "all_gather"))


@pytest.fixture(autouse=True)
def _triton_mode(request, monkeypatch):
    if request.node.name == "test_in_fresh_interpreter":
        yield
        return
    if MODE == "subprocess":
        pytest.skip("triton was imported without TRITON_INTERPRET=1; see test_in_fresh_interpreter")
    if MODE == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def test_in_fresh_interpreter():
    if MODE != "subprocess":
        pytest.skip("the kernels run in this process")
    assert not os.environ.get("_LOOM_KERNEL_TESTS_CHILD"), "TRITON_INTERPRET=1 did not take effect in the subprocess"
    env = dict(os.environ, TRITON_INTERPRET="1", _LOOM_KERNEL_TESTS_CHILD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                          cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_triton_path_is_active():
    for name, kernels in _KERNELS.items():
        for k in kernels:
            fn = getattr(_mods[name], k)
            assert _interpreted(fn) == (MODE == "interpret"), f"{name}.{k}: {type(fn).__name__} in mode {MODE}"


# bf16: the interpreter's fp32 -> bf16 cast is not exactly round-to-nearest-even, so
# allow a few bf16 ulps (2^-8 relative each)
BF16_TOL = dict(atol=2e-2, rtol=3e-2)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, g=None, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


# --------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------
def _make_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, seed, strided_q=False):
    g = _gen(seed)
    n_blk = [(s + bs - 1) // bs for s in seq_lens]
    total = sum(n_blk) + 3
    kc = _randn(total, bs, hkv, d, dtype=dtype, g=g)
    vc = _randn(total, bs, hkv, d, dtype=dtype, g=g)
    perm = torch.randperm(total, generator=g).tolist()  # non-contiguous, shuffled block ids
    bt = torch.full((len(seq_lens), max(n_blk) + 2), 10_000, dtype=torch.int32)  # junk past the end
    i = 0
    for b, n in enumerate(n_blk):
        bt[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    # NaN in every slot no sequence has written: a kernel must not read past a sequence's length
    written = torch.zeros((total, bs), dtype=torch.bool)
    for b, s in enumerate(seq_lens):
        for p in range(s):
            written[bt[b, p // bs], p % bs] = True
    kc[~written.to(kc.device)], vc[~written.to(vc.device)] = float("nan"), float("nan")
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(qsl[-1])
    if strided_q:
        q = _randn(T, hq + 2 * hkv, d, dtype=dtype, g=g)[:, :hq]
    else:
        q = _randn(T, hq, d, dtype=dtype, g=g)
    return q, kc, vc, qsl.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), bt.to(DEVICE)


def _check_attention(q_lens, seq_lens, hq, hkv, d, bs, dtype=torch.float32, splits=(1,), seed=0, strided_q=False,
                     num_decodes=0, seq_order=None):
    q, kc, vc, qsl, sl, bt = _make_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, seed, strided_q)
    scale = d ** -0.5
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale).float()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for ns in splits:
        out = pa.paged_attention(q, kc, vc, qsl, sl, bt, scale, max(q_lens), max(seq_lens), num_kv_splits=ns,
                                 num_decodes=num_decodes,
                                 seq_order=None if seq_order is None else torch.tensor(seq_order, dtype=torch.int32,
                                                                                       device=DEVICE))
        assert out.shape == q.shape and out.dtype == q.dtype
        err = (out.float() - ref).abs().max().item()
        assert err < tol, f"splits={ns}: max err {err}"


def test_attention_ref_batched_decode_matches_one_sequence_at_a_time():
    # the reference batches its decode rows (GQA 3, junk past each block table's end, lengths 1..50,
    # NaN in every cache slot that no sequence has written)
    q, kc, vc, qsl, sl, bt = _make_batch([1, 5, 1, 1, 0, 1], [50, 9, 1, 17, 4, 33], 6, 2, 16, 4, torch.float32, 7)
    got = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.25)
    want = torch.empty_like(q)
    for i in (0, 1, 2, 3, 5):
        pa._sequence_ref(want, q, kc, vc, qsl, sl, bt, 0.25, i)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sdpa_cpu_path_matches_ref(dtype):
    # the CPU path (torch SDPA): decodes of different lengths (NaN past each), a whole prompt,
    # a chunk continuing a cached prefix, GQA 4:2
    # (a decode after the prefills too); then one SdpaPlan shared by two layers' caches, as a step does
    from kernels.sdpa_attention import SdpaPlan, paged_attention_sdpa
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    q, kc, vc, qsl, sl, bt = _make_batch([1, 1, 7, 5, 1], [9, 33, 7, 21, 1], 4, 2, 16, 4, dtype, seed=5)
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.25).float()
    out = paged_attention_sdpa(q, kc, vc, qsl, sl, bt, 0.25)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **tol)
    plan = SdpaPlan.build(qsl, sl, bt, kc.shape[1], kc.shape[2], dtype)
    kc2, vc2 = vc * 0.5 + 1, kc - 1  # another layer's values (NaN in the same unwritten slots)
    for k_cache, v_cache in ((kc, vc), (kc2, vc2)):
        out = paged_attention_sdpa(q, k_cache, v_cache, qsl, sl, bt, 0.25, plan)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), pa.paged_attention_ref(q, k_cache, v_cache, qsl, sl, bt, 0.25).float(),
                                   **tol)


def test_attention_mixed_prefill_chunked_decode():
    # prefill (q_len == seq_len), chunked prefill / prefix hit (q_len < seq_len), decode, empty seq; GQA 2
    _check_attention([6, 1, 4, 0, 1, 3], [6, 21, 13, 9, 1, 30], hq=4, hkv=2, d=32, bs=4, splits=(1, 3))
    # decodes first + the num_decodes hint: two launches (decode tiling / prefill tiling, multi-tile)
    # (group 8: 8-token query tiles, so the prefill launch's first tiles fall before its first sequence)
    _check_attention([1] * 9 + [20, 3], [30, 7, 50, 3, 9, 12, 1, 40, 16, 25, 20], hq=8, hkv=1, d=16, bs=8,
                     splits=(None, 2), num_decodes=9, seed=5)


def test_attention_writes_into_out():
    # out=: the first T rows of a larger buffer, as piecewise CUDA graphs pass it (a fixed
    # address); rows past T stay as they were. Mixed decodes and prompts, two launches.
    q, kc, vc, qsl, sl, bt = _make_batch([1, 1, 6, 3], [9, 30, 6, 12], 4, 2, 16, 4, torch.float32, seed=2)
    buf = torch.full((q.shape[0] + 5, *q.shape[1:]), 7.0, device=DEVICE)
    got = pa.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, 6, 30, num_decodes=2, out=buf[:q.shape[0]])
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got, pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.25), atol=2e-5, rtol=1e-5)
    assert (buf[q.shape[0]:] == 7.0).all()


def test_attention_multi_tile_gqa3_strided_query():
    # q_len * group > BLOCK_M: several query tiles per sequence (binary-search path); group 3 (not a power of 2)
    _check_attention([27, 1, 9], [40, 17, 9], hq=6, hkv=2, d=16, bs=8, splits=(1, 2), strided_q=True)


def test_attention_decode_split_kv():
    # pure decode, long-ish context, splits forced on (incl. a non-power-of-2 count) and automatic
    q_lens, seq_lens = [1, 1, 1], [70, 5, 130]
    _check_attention(q_lens, seq_lens, hq=8, hkv=2, d=32, bs=16, splits=(1, 4, 5))
    # the automatic choice: splits only for decode batches that leave SMs idle on long contexts
    assert pa.choose_num_kv_splits(1, 1, 1, 4096, torch.device("cpu")) > 1
    assert pa.choose_num_kv_splits(1, 1, 7, 4096, torch.device("cpu")) == 1
    assert pa.choose_num_kv_splits(1, 1, 1, 50, torch.device("cpu")) == 1
    # (the CPU counts as 4 SMs) 2.5 programs per SM split two ways, 3 do not; a split a few ways
    # streams 128-key tiles two stages deep, one split many ways is not pipelined
    assert pa.choose_num_kv_splits(5, 2, 1, 4096, torch.device("cpu")) == 2
    assert pa.choose_num_kv_splits(6, 2, 1, 4096, torch.device("cpu")) == 1
    assert pa.tile_config(2, 128, 1, False, 2)["block_n"] == 128
    assert pa.tile_config(2, 128, 1, False, 32)["num_stages"] == 1
    _check_attention([1], [600], hq=2, hkv=1, d=16, bs=16, splits=(None,), seed=3)


def test_attention_short_prompt_chunk():
    # a chunk with fewer (query tile, KV head) programs than SMs (the CPU counts as 4) streams 64 keys
    # per step, and over 512+ keys of context splits its KV in two; equal to the reference either way
    assert pa.choose_chunk_kv_splits(0.75, 600) == 2
    assert pa.choose_chunk_kv_splits(0.75, 300) == 1   # too little context
    assert pa.choose_chunk_kv_splits(1.5, 4096) == 1   # enough programs
    assert pa.tile_config(8, 128, 140, False, 2, 0.5)["block_n"] == 64
    assert pa.tile_config(8, 128, 140, False, 1, 4.0)["block_n"] == 32
    _check_attention([12], [600], hq=8, hkv=1, d=32, bs=16, dtype=torch.bfloat16, splits=(None, 1))
    _check_attention([1, 1, 12], [50, 700, 600], hq=8, hkv=1, d=32, bs=16, dtype=torch.bfloat16, splits=(None,),
                     num_decodes=2, seed=3)


def test_attention_decode_longest_first():
    # seq_order: programs take the sequences in the given order (a permutation), KV heads side by
    # side; every sequence still gets its own output, with and without splits
    seq_lens = [70, 5, 130, 1, 33]
    order = sorted(range(5), key=lambda i: -seq_lens[i])
    _check_attention([1] * 5, seq_lens, hq=6, hkv=3, d=16, bs=8, splits=(1, 2), seq_order=order)
    # a mixed batch: the order covers its leading decodes, and the prompt chunk after them is untouched
    _check_attention([1] * 5 + [7], seq_lens + [40], hq=6, hkv=3, d=16, bs=8, splits=(None,), num_decodes=5,
                     seq_order=order)


def test_attention_bf16():
    _check_attention([5, 1, 3], [5, 40, 19], hq=4, hkv=1, d=32, bs=8, dtype=torch.bfloat16, splits=(1, 2))


def _dense_attention(q, kc, vc, qsl, sl, bt, scale, window=None, cap=None, sinks=None):
    """An independent oracle: each sequence's keys gathered whole, a [Q, S] mask from the
    positions (HF's sliding window: p - window < k <= p), the soft cap before it; sinks [Hq]:
    exp(sink) added to each head's softmax denominator."""
    bs, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i in range(len(sl)):
        lo, hi, n = int(qsl[i]), int(qsl[i + 1]), int(sl[i])
        if hi == lo:
            continue
        slots = [int(bt[i, p // bs]) * bs + p % bs for p in range(n)]
        k = kc.reshape(-1, hkv, d)[slots].float().cpu().repeat_interleave(q.shape[1] // hkv, 1)  # [S, Hq, D]
        v = vc.reshape(-1, hkv, d)[slots].float().cpu().repeat_interleave(q.shape[1] // hkv, 1)
        s = torch.einsum("qhd,shd->hqs", q[lo:hi].float().cpu(), k) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        q_pos, k_pos = torch.arange(n - (hi - lo), n)[:, None], torch.arange(n)[None, :]
        seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window is not None else True)
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, -1)
        else:   # exp(s - m) / (sum exp(s - m) + exp(sink - m)), m the row's max over keys and sink
            sink = sinks.float().cpu()[:, None, None]
            m = torch.maximum(s.amax(-1, keepdim=True), sink)
            e = torch.exp(s - m)
            p = e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
        out[lo:hi] = torch.einsum("hqs,shd->qhd", p, v)
    return out


def _trim_before_windows(kc, vc, qsl, sl, bt, window):
    """What a trimmed cache looks like: every block wholly before a sequence's first query's
    window is freed, its block-table entry left pointing at a block of NaN. Returns the
    caches (one NaN block more) and the trimmed table."""
    bs = kc.shape[1]
    nan_block = kc.shape[0]
    kc = torch.cat([kc, torch.full_like(kc[:1], float("nan"))])
    vc = torch.cat([vc, torch.full_like(vc[:1], float("nan"))])
    bt = bt.clone()
    for i in range(len(sl)):
        first = max(0, int(sl[i]) - int(qsl[i + 1] - qsl[i]) - window + 1)
        bt[i, :first // bs] = nan_block
    return kc, vc, bt


@pytest.mark.parametrize("window, cap", [(5, None), (16, None), (None, 4.0), (6, 2.5)])
def test_attention_sliding_window_and_soft_cap(window, cap):
    # windows shorter than, equal to (16: one context) and longer than (16: others) the contexts,
    # a soft cap alone and with a window; over prefills, chunked prefill /
    # prefix hits, decodes and an empty sequence, in one launch and in two (num_decodes), with
    # split-KV; the blocks before each first query's window freed (NaN): nobody may read them.
    # The reference equals a dense oracle, the Triton kernel and the CPU SDPA path equal it.
    from kernels.sdpa_attention import paged_attention_sdpa
    cases = [  # (q_lens, seq_lens, hq, hkv, d, bs, splits, num_decodes)
        ([6, 1, 4, 0, 1, 16], [6, 21, 13, 9, 1, 30], 4, 2, 32, 4, (3,), 0),
        ([1, 1, 1, 27, 9], [70, 5, 16, 40, 9], 6, 2, 16, 8, (None,), 3),   # multi-tile (group 3)
    ]
    for q_lens, seq_lens, hq, hkv, d, bs, splits, nd in cases:
        q, kc, vc, qsl, sl, bt = _make_batch(q_lens, seq_lens, hq, hkv, d, bs, torch.float32, seed=4)
        scale = d ** -0.5
        want = _dense_attention(q, kc, vc, qsl, sl, bt, scale, window, cap)
        if window is not None:
            kc, vc, bt = _trim_before_windows(kc, vc, qsl, sl, bt, window)
        ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale, window, cap).float()
        rows = torch.tensor([i for i, n in enumerate(q_lens) for _ in range(n)])
        assert not ref.isnan().any()
        torch.testing.assert_close(ref.cpu(), want, atol=2e-5, rtol=1e-5)
        if window is not None and window >= max(seq_lens):   # a window wider than the context: full attention
            torch.testing.assert_close(ref, pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale, None, cap).float())
        for ns in splits:
            out = pa.paged_attention(q, kc, vc, qsl, sl, bt, scale, max(q_lens), max(seq_lens), num_kv_splits=ns,
                                     num_decodes=nd, sliding_window=window, logits_soft_cap=cap)
            err = (out.float() - ref).abs().max().item()
            assert err < 2e-5, f"splits={ns}: max err {err}"
        if DEVICE == "cpu":
            out = paged_attention_sdpa(q, kc, vc, qsl, sl, bt, scale, None, window, cap)
            torch.testing.assert_close(out[rows].float(), ref[rows], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_sinks(window):
    # gpt-oss's per-head sink logit in the softmax denominator, with full and sliding-window
    # layers: the reference equals a dense oracle; the Triton kernel (unsplit, split-KV: the sink
    # joins the merge once, and two launches) and the CPU SDPA path equal the reference
    from kernels.sdpa_attention import paged_attention_sdpa
    cases = [  # (q_lens, seq_lens, hq, hkv, d, bs, splits, num_decodes)
        ([6, 1, 4, 0, 1, 16], [6, 21, 13, 9, 1, 30], 4, 2, 32, 4, (1, 3), 0),
        ([1, 1, 1, 27, 9], [70, 5, 16, 40, 9], 6, 2, 16, 8, (None, 4), 3),
    ]
    for q_lens, seq_lens, hq, hkv, d, bs, splits, nd in cases:
        q, kc, vc, qsl, sl, bt = _make_batch(q_lens, seq_lens, hq, hkv, d, bs, torch.float32, seed=5)
        sinks = torch.randn(hq, generator=_gen(7)).mul_(2.0).to(DEVICE)
        sinks[0] = 6.0   # a sink that outweighs the keys
        scale = d ** -0.5
        want = _dense_attention(q, kc, vc, qsl, sl, bt, scale, window, None, sinks)
        if window is not None:
            kc, vc, bt = _trim_before_windows(kc, vc, qsl, sl, bt, window)
        ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale, window, None, sinks).float()
        rows = torch.tensor([i for i, n in enumerate(q_lens) for _ in range(n)])
        torch.testing.assert_close(ref[rows].cpu(), want[rows], atol=2e-5, rtol=1e-5)
        plain = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale, window).float()
        assert (plain[rows] - ref[rows]).abs().max() > 1e-2   # the sinks change the output
        for ns in splits:
            out = pa.paged_attention(q, kc, vc, qsl, sl, bt, scale, max(q_lens), max(seq_lens), num_kv_splits=ns,
                                     num_decodes=nd, sliding_window=window, sinks=sinks)
            err = (out[rows].float() - ref[rows]).abs().max().item()
            assert err < 2e-5, f"splits={ns}: max err {err}"
        if DEVICE == "cpu":
            out = paged_attention_sdpa(q, kc, vc, qsl, sl, bt, scale, None, window, None, sinks)
            torch.testing.assert_close(out[rows].float(), ref[rows], atol=2e-5, rtol=1e-5)


def test_attention_sliding_window_bf16_decode_split():
    # bf16, long decodes split many ways over a short window (each split a few keys, some none)
    q_lens, seq_lens = [1, 1, 1, 12], [300, 40, 7, 200]
    q, kc, vc, qsl, sl, bt = _make_batch(q_lens, seq_lens, 8, 1, 32, 16, torch.bfloat16, seed=6)
    kc, vc, bt = _trim_before_windows(kc, vc, qsl, sl, bt, 48)
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.2, 48, 30.0).float()
    for ns in (None, 8):
        out = pa.paged_attention(q, kc, vc, qsl, sl, bt, 0.2, 12, 300, num_kv_splits=ns, num_decodes=3,
                                 sliding_window=48, logits_soft_cap=30.0)
        torch.testing.assert_close(out.float(), ref, **BF16_TOL)


# --------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    g = _gen(2)
    eps = 1e-6
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    x = _randn(7, 96, dtype=dtype, g=g, scale=3.0)
    w = _randn(96, dtype=dtype, g=g)
    torch.testing.assert_close(rn.rms_norm(x, w, eps), rn.rms_norm_ref(x, w, eps), **tol)
    # Qwen3 per-head q/k norm: [T, H, D] views of a fused projection
    qkv = _randn(5, 3 * 4 * 32, dtype=dtype, g=g)
    q = qkv[:, :128].view(5, 4, 32)
    wq = _randn(32, dtype=dtype, g=g)
    out = rn.rms_norm(q, wq, eps)
    assert out.shape == q.shape
    torch.testing.assert_close(out, rn.rms_norm_ref(q, wq, eps), **tol)
    torch.testing.assert_close(out.view(20, 32), rn.rms_norm_ref(q.reshape(20, 32), wq, eps), **tol)
    # fused residual add
    r = _randn(7, 96, dtype=dtype, g=g)
    out, new_r = rn.fused_add_rms_norm(x, r, w, eps)
    out_ref, new_r_ref = rn.fused_add_rms_norm_ref(x, r, w, eps)
    exact = dtype == torch.float32 or not INTERPRET  # (the interpreter's bf16 rounding is approximate)
    # ... and on [T, H, D] views, as for Qwen3's per-head norms
    qr = _randn(5, 4, 32, dtype=dtype, g=g)
    o3, nr3 = rn.fused_add_rms_norm(q, qr, wq, eps)
    o3_ref, nr3_ref = rn.fused_add_rms_norm_ref(q, qr, wq, eps)
    torch.testing.assert_close(nr3, nr3_ref, **(dict(atol=0, rtol=0) if exact else tol))
    torch.testing.assert_close(o3, o3_ref, **tol)
    torch.testing.assert_close(new_r, new_r_ref, **(dict(atol=0, rtol=0) if exact else tol))
    torch.testing.assert_close(out, out_ref, **tol)


def _ptrs(ts: list[torch.Tensor]) -> torch.Tensor:
    """Every "rank's" tensor address, as the kernels over symmetric memory take them."""
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)


def _flags_with_peers_signalled(world: int, rank: int, cells: int) -> list[torch.Tensor]:
    """Every rank's flags [cells, world], with every peer's signal to `rank` already raised."""
    flags = [torch.zeros(cells, world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    flags[rank][:, [p for p in range(world) if p != rank]] = 1
    return flags


def _check_flags_after_call(flags: list[torch.Tensor], world: int, rank: int) -> None:
    """`rank` took its own signals and raised one in every peer's flags, per cell."""
    for p in range(world):
        want = torch.zeros(flags[p].shape, dtype=torch.int32)
        if p != rank:
            want[:, rank] = 1
        assert torch.equal(flags[p].cpu(), want), (p, flags[p])


@pytest.mark.parametrize("dtype,world,rank,rows,programs", [
    (torch.float32, 2, 0, 3, None), (torch.bfloat16, 2, 1, 3, None), (torch.float32, 4, 2, 3, None),
    (torch.float32, 2, 1, 7, 3)])
def test_allreduce_add_rms_norm(dtype, world, rank, rows, programs):
    """One rank's call with every peer's signal already raised (the peers' buffers are
    ordinary tensors here): the rank-order sum, residual add and norm equal the reference;
    the rank consumes its own flags and raises its flag in every peer's, one per program
    (one per row, or with fewer programs than rows, each program's rows in a loop)."""
    g = _gen(5)
    h, eps = 96, 1e-6
    parts = [_randn(rows, h, dtype=dtype, g=g) for _ in range(world)]
    residual = _randn(rows, 2 * h, dtype=dtype, g=g)[:, :h]  # a strided residual
    w = _randn(h, dtype=dtype, g=g)
    flags = _flags_with_peers_signalled(world, rank, min(rows, programs or rows))
    out, new_r = arn.allreduce_add_rms_norm(_ptrs(parts), _ptrs(flags), rank, rows, residual, w, eps,
                                            programs=programs or rows)
    out_ref, new_r_ref = arn.allreduce_add_rms_norm_ref(parts, residual, w, eps)
    exact = dtype == torch.float32 or not INTERPRET  # (the interpreter's bf16 rounding is approximate)
    tol = dict(atol=0, rtol=0) if exact else BF16_TOL
    torch.testing.assert_close(new_r, new_r_ref, **tol)
    torch.testing.assert_close(out, out_ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL))
    _check_flags_after_call(flags, world, rank)


@pytest.mark.parametrize("dtype,world,rank,rows", [
    (torch.float32, 2, 1, 3), (torch.float32, 4, 2, 2), (torch.bfloat16, 2, 0, 1)])
def test_lamport_add_rms_norm(dtype, world, rank, rows):
    """One rank's flagless call with every peer's part already in its inbox (the inboxes are
    ordinary tensors here): the rank-order sum, residual add and norm equal the reference; the
    rank's own part went to every peer's inbox, a -0.0 in it as +0.0 (-0.0 is the sentinel of a
    part not yet arrived), and its own inbox is all sentinel again, ready for the call after next."""
    g = _gen(7)
    h, eps = 96, 1e-6
    parts = [_randn(rows, h, dtype=dtype, g=g) for _ in range(world)]
    parts[rank][0, 0] = -0.0
    residual = _randn(rows, 2 * h, dtype=dtype, g=g)[:, :h]
    w = _randn(h, dtype=dtype, g=g)
    bits, sentinel, stride = arn.INT_OF[parts[0].element_size()], arn.sentinel(dtype), rows * h + 8
    inboxes = [torch.full((world * stride,), sentinel, dtype=bits, device=DEVICE) for _ in range(world)]
    for p in range(world):
        if p != rank:
            inboxes[rank][p * stride:p * stride + rows * h] = parts[p].reshape(-1).view(bits)
    out, new_r = arn.lamport_add_rms_norm(parts[rank], _ptrs(inboxes), stride, rank, residual, w, eps)
    out_ref, new_r_ref = arn.allreduce_add_rms_norm_ref(parts, residual, w, eps)
    exact = dtype == torch.float32 or not INTERPRET
    torch.testing.assert_close(new_r, new_r_ref, **(dict(atol=0, rtol=0) if exact else BF16_TOL))
    torch.testing.assert_close(out, out_ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL))
    sent = parts[rank].clone()
    sent[0, 0] = 0.0
    for p in range(world):
        got = inboxes[p].cpu()
        if p != rank:
            assert torch.equal(got[rank * stride:rank * stride + rows * h], sent.reshape(-1).view(bits).cpu()), p
            got = torch.cat([got[:rank * stride], got[rank * stride + rows * h:]])
        assert bool((got == sentinel).all()), p


@needs_cuda
@pytest.mark.parametrize("lamport", [False, True], ids=["pulled", "lamport"])
def test_allreduce_add_rms_norm_two_ranks_at_once(lamport):
    """Two ranks' calls running at the same time on two streams of one GPU, each between a GEMV
    that writes its part and a GEMV that reads the norm, as in a tensor-parallel decode layer:
    every call waits for the other rank's signal (or part, lamport), the two buffer slots
    alternate, and each of 40 calls equals the reference on both ranks, with the flags back at
    zero (the inboxes all sentinel). PDL is off here:
    with it, a GEMV launches while its rank still waits, and on one GPU its programs can take
    the SMs the other rank needs to get there (on two GPUs, tests/test_gpu_tp.py runs it on)."""
    from kernels.gemv import gemv
    from kernels.jit import set_pdl
    before = set_pdl(False)
    try:
        _two_ranks_at_once(gemv, lamport)
    finally:
        set_pdl(before)


def _two_ranks_at_once(gemv, lamport: bool):
    g = _gen(6)
    world, rows, h, k, n2, eps = 2, 1, 1024, 2048, 6144, 1e-6   # Qwen3-0.6B's o_proj and gate_up
    bf = torch.bfloat16
    x = [_randn(rows, k, dtype=bf, g=g) for _ in range(world)]
    w_in = [_randn(h, k, dtype=bf, g=g) / 32 for _ in range(world)]
    w_out = _randn(n2, h, dtype=bf, g=g) / 64
    norm_w = _randn(h, dtype=bf, g=g)
    residual = _randn(rows, h, dtype=bf, g=g)
    bufs = [[torch.empty(rows, h, dtype=bf, device=DEVICE) for _ in range(world)] for _ in range(2)]  # [slot][rank]
    flags = [[torch.zeros(rows, world, dtype=torch.int32, device=DEVICE) for _ in range(world)] for _ in range(2)]
    buf_ptrs, flag_ptrs = [_ptrs(b) for b in bufs], [_ptrs(f) for f in flags]
    bits, sentinel, stride = torch.int16, arn.sentinel(bf), rows * h
    inboxes = [[torch.full((world * stride,), sentinel, dtype=bits, device=DEVICE) for _ in range(world)]
               for _ in range(2)]  # [slot][rank]
    inbox_ptrs = [_ptrs(b) for b in inboxes]

    def fused(slot, r):
        if lamport:
            return arn.lamport_add_rms_norm(bufs[slot][r], inbox_ptrs[slot], stride, r, residual, norm_w, eps)
        return arn.allreduce_add_rms_norm(buf_ptrs[slot], flag_ptrs[slot], r, rows, residual, norm_w, eps)
    streams = [torch.cuda.Stream() for _ in range(world)]
    parts = [gemv(x[r], w_in[r])[0] for r in range(world)]
    want, want_r = arn.allreduce_add_rms_norm_ref(parts, residual, norm_w, eps)
    # every kernel compiled and loaded first, one rank at a time (the peer's signal raised by
    # hand): loading a module waits for the GPU to go idle, which a rank waiting for the
    # other's signal never does
    gemv(want, w_out)
    for r in range(world):
        if lamport:
            inboxes[0][r][(1 - r) * stride:(2 - r) * stride] = parts[1 - r].reshape(-1).view(bits)
        else:
            flags[0][r][:, 1 - r] = 1
        bufs[0][r].copy_(parts[r])
        fused(0, r)
        torch.cuda.synchronize()
        flags[0][1 - r].zero_()
        inboxes[0][1 - r].fill_(sentinel)
    torch.cuda.synchronize()
    for it in range(40):
        slot, outs = it % 2, [None] * world
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                gemv(x[r], w_in[r], out=bufs[slot][r])
                normed, new_r = fused(slot, r)
                outs[r] = (normed, new_r, gemv(normed, w_out)[0])
        torch.cuda.synchronize()
        torch.testing.assert_close(outs[0][0], want, **BF16_TOL)
        assert torch.equal(outs[0][1], want_r), it
        for normed, new_r, y in outs:  # every rank has the same bits
            assert torch.equal(normed, outs[0][0]) and torch.equal(new_r, want_r), it
            assert torch.equal(y, gemv(outs[0][0], w_out)[0]), it
        assert all(int(f.abs().sum()) == 0 for f in flags[slot]), (it, flags[slot])
        assert all(bool((b == sentinel).all()) for b in inboxes[slot]), it


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2)])
def test_all_gather(world, rank):
    """One rank's call with every peer's signal already raised: the parts side by side, the
    vocabulary's padding dropped (2 rows, parts of 2,500 columns: two programs per row); the
    rank consumes its own flags and raises its flag in every peer's, one per program."""
    g = _gen(8)
    rows, part = 2, 2500
    n_out = part * world - 7
    cells = ag.flag_cells(rows, part)
    assert cells == 2 * rows
    parts = [_randn(rows, part, g=g) for _ in range(world)]
    flags = _flags_with_peers_signalled(world, rank, cells)
    out = ag.all_gather(_ptrs(parts), _ptrs(flags), rank, rows, part, n_out, parts[0])
    assert out.shape == (rows, n_out) and torch.equal(out, ag.all_gather_ref(parts, n_out))
    _check_flags_after_call(flags, world, rank)


@needs_cuda
def test_all_gather_two_ranks_at_once():
    """Two ranks' gathers at the same time on two streams of one GPU, each after a GEMV that
    writes its part (the lm_head): 40 calls, both ranks get every part in rank order, and the
    flags are back at zero after each. PDL off, as in the all-reduce test above."""
    from kernels.gemv import gemv
    from kernels.jit import set_pdl
    before = set_pdl(False)
    try:
        g = _gen(9)
        world, rows, h, part = 2, 1, 1024, 6000
        bf = torch.bfloat16
        x = [_randn(rows, h, dtype=bf, g=g) for _ in range(world)]
        w = [_randn(part, h, dtype=bf, g=g) / 32 for _ in range(world)]
        bufs = [torch.empty(rows, part, dtype=bf, device=DEVICE) for _ in range(world)]
        flags = [torch.zeros(ag.flag_cells(rows, part), world, dtype=torch.int32, device=DEVICE)
                 for _ in range(world)]
        buf_ptrs, flag_ptrs = _ptrs(bufs), _ptrs(flags)
        want = ag.all_gather_ref([gemv(x[r], w[r])[0] for r in range(world)], 2 * part - 3)
        for r in range(world):  # compiled and loaded one rank at a time (see _two_ranks_at_once)
            flags[r][:, 1 - r] = 1
            ag.all_gather(buf_ptrs, flag_ptrs, r, rows, part, 2 * part - 3, x[0])
            torch.cuda.synchronize()
            flags[1 - r].zero_()
        streams = [torch.cuda.Stream() for _ in range(world)]
        for it in range(40):
            outs = [None] * world
            for r in range(world):
                with torch.cuda.stream(streams[r]):
                    gemv(x[r], w[r], out=bufs[r])
                    outs[r] = ag.all_gather(buf_ptrs, flag_ptrs, r, rows, part, 2 * part - 3, x[r])
            torch.cuda.synchronize()
            assert all(torch.equal(o, want) for o in outs), it
            assert all(int(f.abs().sum()) == 0 for f in flags), it
    finally:
        set_pdl(before)


# --------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------
def _hf_inv_freq(rope_scaling, head_dim, base):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = dict(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=base,
              max_position_embeddings=4096)
    if rope_scaling is not None:
        kw["rope_scaling"] = dict(rope_scaling)
    cfg = LlamaConfig(**kw)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")[0]
    # transformers >= 5 keeps the default init on the model's rotary class
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)[0]


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "default"},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
])
def test_build_rope_cache_matches_transformers(rope_scaling):
    head_dim, base, max_pos = 64, 500000.0, 300
    inv_freq = _hf_inv_freq(rope_scaling, head_dim, base).float()
    cache = rot.build_rope_cache(head_dim, max_pos, base, rope_scaling)
    assert cache.shape == (max_pos, head_dim) and cache.dtype == torch.float32
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]  # as HF's forward
    torch.testing.assert_close(cache[:, :head_dim // 2], freqs.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, head_dim // 2:], freqs.sin(), atol=1e-6, rtol=0)
    if rope_scaling and rope_scaling["rope_type"] == "llama3":
        alias = {("type" if k == "rope_type" else k): v for k, v in rope_scaling.items()}
        assert torch.equal(rot.build_rope_cache(head_dim, max_pos, base, alias), cache)
        assert not torch.allclose(cache, rot.build_rope_cache(head_dim, max_pos, base, None))


def test_rotary_reference_is_hf_rotate_half():
    # the reference (which the fused prologue kernel is checked against) follows HF's convention
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    g = _gen(3)
    T, hq, hkv, d = 6, 4, 2, 32
    cache = rot.build_rope_cache(d, 64, 10000.0, None)
    q, k = torch.randn(T, hq, d, generator=g), torch.randn(T, hkv, d, generator=g)
    pos = torch.randint(0, 64, (T,), generator=g)
    qo, ko = rot.rotary_embedding_ref(pos, q, k, cache)
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    torch.testing.assert_close(qo, qh.transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ko, kh.transpose(0, 1), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------
# the fused attention prologue: q/k norm + rotary + KV-cache write
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,norm,rot_dim,neox", [
    (torch.float32, True, 32, True), (torch.bfloat16, True, 32, True), (torch.bfloat16, False, 32, True),
    (torch.float32, True, 16, True),
    # GPT-J style (interleaved pairs): Cohere (whole head), GLM (the first half of each head)
    (torch.float32, True, 32, False), (torch.bfloat16, False, 32, False), (torch.float32, False, 16, False),
    (torch.bfloat16, True, 16, False)])
def test_qk_norm_rope_cache(dtype, norm, rot_dim, neox):
    g = _gen(6)
    T, hq, hkv, d, bs, nb = 7, 6, 2, 32, 4, 6  # GQA 3 (a head count that is not a power of 2)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # cos/sin scaled by mscale
    cache = rot.build_rope_cache(rot_dim, 64, 10000.0, yarn if rot_dim < d else None).to(DEVICE)
    qkv = _randn(T, (hq + 2 * hkv) * d, dtype=dtype, g=g, scale=2.0)  # views of a fused projection
    q = qkv[:, :hq * d].view(T, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    pos = torch.randint(0, 64, (T,), generator=g).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[1, 5]] = -1  # padding tokens: their keys and values are not written
    slots = slots.to(DEVICE)
    qw, kw = (_randn(d, dtype=dtype, g=g), _randn(d, dtype=dtype, g=g)) if norm else (None, None)
    kc, vc = _randn(nb, bs, hkv, d, dtype=dtype, g=g), _randn(nb, bs, hkv, d, dtype=dtype, g=g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    before = qkv.clone()
    out = qrc.qk_norm_rope_cache(pos, q, k, v, cache, kc, vc, slots, qw, kw, 1e-6, is_neox_style=neox)
    ref = qrc.qk_norm_rope_cache_ref(pos, q, k, v, cache, kc_ref, vc_ref, slots, qw, kw, 1e-6, is_neox_style=neox)
    other = qrc.qk_norm_rope_cache_ref(pos, q, k, v, cache, kc_ref.clone(), vc_ref.clone(), slots, qw, kw, 1e-6,
                                       is_neox_style=not neox)
    assert not torch.allclose(ref.float(), other.float(), atol=1e-2)  # the two styles differ here
    if rot_dim < d:  # the dims past the rotary ones pass through (normed, when there is a norm)
        rest = q[..., rot_dim:] if qw is None else qrc.rms_norm_ref(q, qw, 1e-6)[..., rot_dim:]
        assert torch.equal(ref[..., rot_dim:], rest)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(kc, kc_ref, **tol)
    assert torch.equal(vc, vc_ref) and torch.equal(qkv, before)


# --------------------------------------------------------------------------
# SiLU-and-mul
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    g = _gen(5)
    x = _randn(5, 2 * 80, dtype=dtype, g=g, scale=3.0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    out = act.silu_and_mul(x)
    assert out.shape == (5, 80) and out.dtype == dtype
    torch.testing.assert_close(out, act.silu_and_mul_ref(x), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype):
    """GeGLU (Gemma): HF's gelu_pytorch_tanh on the gate, over a range that reaches both tails."""
    g = _gen(6)
    x = _randn(5, 2 * 80, dtype=dtype, g=g, scale=4.0)
    x[0, :4] = torch.tensor([-30.0, -8.0, 8.0, 30.0], dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    out = act.gelu_tanh_and_mul(x)
    assert out.shape == (5, 80) and out.dtype == dtype
    torch.testing.assert_close(out, act.gelu_tanh_and_mul_ref(x), **tol)


# --------------------------------------------------------------------------
# a decode graph's input kernel
# --------------------------------------------------------------------------
def test_decode_inputs():
    """Fed rows take the previous step's token, the others the staged one; each row's packed
    table columns land at the row's start in the wide table, the columns past them untouched."""
    staged = torch.tensor([5, 6, 7, 8], device=DEVICE)
    feed = torch.tensor([-1, 2, -1, 0], device=DEVICE)
    prev = torch.tensor([50, 51, 52], device=DEVICE)
    width = 300  # more than one BLOCK of columns
    packed = torch.arange(4 * width, dtype=torch.int32, device=DEVICE)
    for fn in (dec.decode_inputs, dec.decode_inputs_ref):
        ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        table = torch.full((4, 512), -7, dtype=torch.int32, device=DEVICE)
        fn(staged, feed, prev, packed, torch.tensor([width], dtype=torch.int32, device=DEVICE), ids, table)
        assert ids.tolist() == [5, 52, 7, 50]
        assert torch.equal(table[:, :width], packed.view(4, width))
        assert (table[:, width:] == -7).all()


# --------------------------------------------------------------------------
# the vocab-parallel embedding of one rank
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_embedding(dtype):
    """Rank 1 of 3 over a vocabulary of 10 (rows 4-7 of the padded 12): its ids get their rows,
    every other id (below, above, and in the padding) a zero row; the two ranks' parts of a
    2-way split sum to the whole lookup; a row wider than one block (1,100 columns)."""
    g = _gen(5)
    table = _randn(12, 1100, dtype=dtype, g=g)
    ids = torch.tensor([0, 4, 7, 8, 5, 11, 4, 3], device=DEVICE)
    mine = table[4:8].contiguous()
    want = emb.vocab_parallel_embedding_ref(ids, mine, 4)
    assert (want[[0, 3, 5, 7]] == 0).all() and torch.equal(want[1], table[4]) and torch.equal(want[2], table[7])
    out = torch.full((8, 1100), float("nan"), dtype=dtype, device=DEVICE)
    assert emb.vocab_parallel_embedding(ids, mine, 4, out=out) is out
    assert torch.equal(out, want)
    halves = [emb.vocab_parallel_embedding(ids, table[r * 6:(r + 1) * 6].contiguous(), r * 6) for r in (0, 1)]
    assert torch.equal(halves[0] + halves[1], torch.nn.functional.embedding(ids, table))


# --------------------------------------------------------------------------
# decode GEMV with its fused prologues
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "add_rms_norm", "silu_mul"])
def test_gemv(prologue, dtype):
    g = _gen(11)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else BF16_TOL
    n, k = 44, 200  # neither a multiple of the tiles below
    w = _randn(n, k, dtype=dtype, g=g, scale=0.1)
    bias = _randn(n, dtype=dtype, g=g)
    nw = _randn(k, dtype=dtype, g=g)
    tiles = dict(block_n=8, block_k=64, num_warps=4, num_stages=1)
    even = dict(block_n=4, block_k=8, num_warps=4, num_stages=1)  # divide [44, 200]: no masks
    split = dict(tiles, fuse=False)  # the prologue's own kernel, then the plain GEMV
    # above 8 rows, kernels/skinny_gemm.py: K in 3 splits of 2 x 32 (the last one short), or one
    # pass with the product transposed
    mma = dict(block_n=16, block_k=32, split_k=3, num_warps=4, num_stages=1)
    mma_swap = dict(block_n=16, block_k=64, split_k=1, swap=True, num_warps=4, num_stages=1)

    def close(y, y_ref):  # bf16: a sum of k products cancels, so allow ulps of the largest output
        scale = (4e-2 if INTERPRET else 1e-2) * y_ref.abs().max().item()
        torch.testing.assert_close(y, y_ref, **(dict(atol=scale, rtol=0) if dtype == torch.bfloat16 else tol))

    # bf16 changes the loads and the tolerance, not the masks, tiles or splits (the fp32 rows
    # cover those): one row count for each of the two kernels
    for m in (1, 3, 8, 12, 40) if dtype == torch.float32 else (3, 40):
        x = _randn(m, 2 * k if prologue == "silu_mul" else k, dtype=dtype, g=g, scale=2.0)
        r = _randn(m, k, dtype=dtype, g=g)
        kw = dict(prologue=prologue, residual=r if prologue == "add_rms_norm" else None, norm_weight=nw, eps=1e-6)
        if m > gv.MAX_ROWS:
            cases = ((None, mma), (bias, mma), (bias, mma_swap))
            out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
            assert gv.gemv(x, w, out=out, tiles=mma, **kw)[0].data_ptr() == out.data_ptr()
            close(out, gv.gemv_ref(x, w, **kw)[0])
        else:
            cases = ((None, tiles), (bias, tiles), (None, split)) + (((bias, even),) if m == 1 else ())
        for b, t in cases:
            y, new_r = gv.gemv(x, w, b, tiles=t, **kw)
            y_ref, new_r_ref = gv.gemv_ref(x, w, b, **kw)
            assert y.shape == (m, n) and y.dtype == dtype
            close(y, y_ref)
            if prologue == "add_rms_norm":
                torch.testing.assert_close(new_r, new_r_ref, **tol)
            else:
                assert new_r is None
        # into a given buffer (the all-reduce's symmetric buffer), with the default tiles
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        y, _ = gv.gemv(x, w, out=out, **kw)
        assert y.data_ptr() == out.data_ptr()
        close(out, gv.gemv_ref(x, w, **kw)[0])


def test_gemv_row_buckets():
    """Tiles are tuned at 1, 8, 16, 32 and 64 rows; a batch takes its bucket's (tensor-core
    tiles above 8 rows, where the H200 sweep found them faster than cuBLAS; None: cuBLAS)."""
    assert [gv.row_bucket(m) for m in (1, 2, 8, 9, 16, 17, 33, 64)] == [1, 8, 8, 16, 16, 32, 64, 64]
    assert gv.tile_config(4096, 1024, 12, "add_rms_norm")["split_k"] == 1  # Qwen3-0.6B's qkv
    assert gv.tile_config(1024, 2048, 40)["split_k"] > 1  # its o_proj: 1,024 columns over the SMs
    assert gv.tile_config(1024, 3072, 32, "silu_mul") is None  # its down_proj at 17-32 rows: cuBLAS
    assert gv.tile_config(44, 200, 40) is None  # untuned shapes keep cuBLAS above 8 rows


def test_gemv_plain_input_takes_the_split_tiles():
    """A plain input (LoRA's linears: the shrink needs the normed x) of a shape tuned with the
    prologue's own kernel first ("fuse": false) takes those tiles: the plain GEMV they time beat
    cuBLAS. Llama-3.1-8B's qkv, gate_up and down at one row; not at 2-8 rows (cuBLAS there)."""
    for n, k, prologue in ((6144, 4096, "add_rms_norm"), (28672, 4096, "add_rms_norm"), (4096, 14336, "silu_mul")):
        split = gv.tile_config(n, k, 1, prologue)
        assert split is not None and split["fuse"] is False
        plain = gv.tile_config(n, k, 1, "none")
        assert plain == {name: v for name, v in split.items() if name != "fuse"}
        assert gv.tile_config(n, k, 4, "none") is None
    assert gv.tile_config(4096, 4096, 1, "none")["block_n"] == 16   # o_proj: its own ":none" entry


# --------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------
V = 2000


def _sampling_params():
    # rows: greedy, plain, top-k, top-k+top-p, top-p, min-p, top-k=1, k>=V (off), all three, top_p=0, greedy
    temp = [0.0, 1.0, 0.7, 1.3, 1.0, 0.8, 1.0, 1.0, 0.5, 1.0, 0.0]
    top_k = [0, 0, 5, 40, 0, 0, 1, V, 30, 0, 10]
    top_p = [1.0, 1.0, 1.0, 0.8, 0.9, 1.0, 1.0, 1.0, 0.7, 0.0, 0.5]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0]
    return (torch.tensor(temp, device=DEVICE), torch.tensor(top_k, dtype=torch.int32, device=DEVICE),
            torch.tensor(top_p, device=DEVICE), torch.tensor(min_p, device=DEVICE))


def _logits(b, g, scale=3.0):
    x = _randn(b, V, g=g, scale=scale)
    x[0, 17] = x[0].max() + 5.0  # a clear argmax for the first row
    return x


def _allowed_mask(logits, temp, top_k, top_p, min_p):
    """Kept set by sorting (independent of both implementations' threshold search)."""
    b = logits.shape[0]
    allowed = torch.zeros(b, V, dtype=torch.bool)
    for i in range(b):
        lg = logits[i].float().cpu()
        if temp[i] <= 0:
            allowed[i, torch.argmax(lg)] = True
            continue
        p = torch.softmax(lg / float(temp[i]), -1)
        keep = torch.ones(V, dtype=torch.bool)
        if min_p[i] > 0:
            keep &= p >= float(min_p[i]) * p.max() * (1 - 1e-5)
        order = torch.argsort(p, descending=True)
        k = int(top_k[i])
        if 0 < k < V:
            kth = p[order[min(k, int(keep.sum())) - 1]]
            keep &= p >= kth * (1 - 1e-5)
        if top_p[i] < 1:
            pk = torch.where(keep, p, torch.zeros_like(p))
            pk = pk / pk.sum()
            cum = pk[order].cumsum(0)
            n = int(torch.searchsorted(cum, float(top_p[i]) * (1 - 1e-5))) + 1
            keep &= pk >= pk[order[min(n, V) - 1]] * (1 - 1e-5)
        allowed[i] = keep
    return allowed


def test_sample_noise_variant_matches_ref():
    g = _gen(6)
    temp, top_k, top_p, min_p = _sampling_params()
    logits = _logits(temp.shape[0], g)
    for trial in range(2):
        noise = torch.empty(temp.shape[0], V).exponential_(generator=g).to(DEVICE)
        ref = smp.sample_with_noise_ref(logits, temp, top_k, top_p, min_p, noise)
        for max_top_k, p_only in ((0, False), (40, True)):  # candidates for no row / k <= 40 and top-p-only rows
            out = smp.sample_with_noise(logits, temp, top_k, top_p, min_p, noise, max_top_k=max_top_k,
                                        top_p_only=p_only)
            assert out.dtype == torch.int64
            assert out.tolist() == ref.tolist(), max_top_k
    greedy = (temp == 0).cpu()
    assert torch.equal(out.cpu()[greedy], torch.argmax(logits, -1).cpu()[greedy])
    assert out[0].item() == 17
    assert out[6].item() == torch.argmax(logits[6]).item()  # top_k = 1
    assert out[9].item() == torch.argmax(logits[9]).item()  # top_p = 0 keeps one token


def test_sample_top_k_candidates_ties_and_extremes():
    # rows drawing from the top-k candidates (one torch.topk) against the reference and against
    # the full passes: logits with many ties (inside the kept set and at the k-th / last
    # candidate, where a row falls back to the passes), k = 1, p near 0, p = 1, min_p
    g = _gen(13)
    b, v = 12, 700
    logits = _randn(b, v, g=g, scale=3.0)
    logits[:, 100:104] = logits.max(dim=1, keepdim=True).values + 1.0  # four tie for the best
    logits[1, :60] = 20.0            # 60 tie for the best: all kept, within the candidates' slack
    logits[5, 200:400] = 0.5         # a tie at the k-th / last candidate (falls back)
    logits[5, :15] = 9.0
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.5, 1.0, 2.0, 1.0, 0.8, 1.0, 1.0, 0.0], device=DEVICE)
    top_k = torch.tensor([1, 50, 3, 50, 7, 20, 50, 2, 10, 49, 50, 5], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1.0, 0.5, 1.0, 1e-6, 0.9, 1.0, 0.99, 1.0, 0.3, 0.95, 1.0, 0.5], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0], device=DEVICE)
    seeds, positions = torch.arange(b, device=DEVICE) + 3, torch.arange(b, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        lg = logits.to(dtype)
        noise = torch.empty(b, v).exponential_(generator=g).to(DEVICE)
        ref = smp.sample_with_noise_ref(lg, temp, top_k, top_p, min_p, noise).tolist()
        for max_top_k in (50, 10) if dtype == torch.float32 else (50,):  # 10: rows with k > 10 use the passes
            assert smp.sample_with_noise(lg, temp, top_k, top_p, min_p, noise, max_top_k=max_top_k).tolist() == ref
        # rows with top-p and no top-k (1024 candidates > this vocabulary: their top-p sets fit)
        no_k = torch.zeros_like(top_k)
        ref_p = smp.sample_with_noise_ref(lg, temp, no_k, top_p, min_p, noise).tolist()
        assert smp.sample_with_noise(lg, temp, no_k, top_p, min_p, noise, top_p_only=True).tolist() == ref_p
        if dtype == torch.float32:  # Philox: the candidates draw the noise the full passes draw
            r = [2, 3, 8]
            args = (lg[r], temp[r], top_k[r], top_p[r], min_p[r], seeds[r], positions[r])
            assert smp.sample(*args, max_top_k=50).tolist() == smp.sample(*args).tolist()
        assert lg[0, ref[0]] == lg[0].max()  # k = 1: one of the tied best
        assert ref[11] == int(torch.argmax(lg[11].float()))  # greedy


@pytest.mark.parametrize("race_chunks", ["0", "16"])
def test_top_p_route_checks_the_race_winner_and_falls_back(race_chunks, monkeypatch):
    # top-p without top-k (max_top_k 0): the plain chunked race, then the winner's top-p check; a
    # row whose winner lies outside its top-p set searches the threshold. Peaked rows and small p
    # make both outcomes happen; the same tokens as the reference with explicit noise, over one
    # chunk and several, bf16 included, and with Philox: the reference on philox_noise(). The
    # second race split as the first (LOOM_TOP_P_RACE_CHUNKS=0) or over more chunks (16: the
    # vocabulary's 3 here, against 1 or 2 for the first race)
    monkeypatch.setenv("LOOM_TOP_P_RACE_CHUNKS", race_chunks)
    g = _gen(31)
    b, v = 8, 2500
    logits = _randn(b, v, g=g, scale=3.0)
    logits[:, :8] += 6.0  # a few likely tokens: a small top-p set
    temp = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.5, 1.0, 0.8, 1.0], device=DEVICE)
    top_k = torch.tensor([0, 0, 0, 0, 5, 0, 0, 0], dtype=torch.int32, device=DEVICE)  # row 4: top-k there too
    top_p = torch.tensor([0.95, 0.5, 0.9, 0.3, 0.9, 1.0, 0.99, 0.0], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0], device=DEVICE)
    seeds, positions = torch.arange(b, device=DEVICE) + 11, torch.arange(b, device=DEVICE) * 3
    off = torch.ones_like(top_p)
    inside = outside = 0
    # (the second race's split does not depend on the dtype: bf16 once, with the default split)
    for dtype in (torch.float32, torch.bfloat16) if race_chunks == "0" else (torch.float32,):
        lg = logits.to(dtype)
        noise = torch.empty(b, v).exponential_(generator=g).to(DEVICE)
        ref = smp.sample_with_noise_ref(lg, temp, top_k, top_p, min_p, noise).tolist()
        for chunks in (None, 1):
            assert smp.sample_with_noise(lg, temp, top_k, top_p, min_p, noise, num_chunks=chunks).tolist() == ref
        unfiltered = smp.sample_with_noise_ref(lg, temp, top_k * 0, off, min_p, noise).tolist()
        rows = [i for i in (0, 1, 3, 6) if temp[i] > 0]
        inside += sum(ref[i] == unfiltered[i] for i in rows)
        outside += sum(ref[i] != unfiltered[i] for i in rows)
        q = smp.philox_noise(seeds, positions, v)
        assert smp.sample(lg, temp, top_k, top_p, min_p, seeds, positions).tolist() == \
            smp.sample_with_noise_ref(lg, temp, top_k, top_p, min_p, q).tolist()
        assert ref[2] == int(lg[2].float().argmax()) and ref[7] == int(lg[7].float().argmax())  # greedy, p = 0
    assert inside and outside   # both the accepted winner and the fallback ran


def test_sample_chunked_rows_match():
    # rows without top-k/top-p may be split over vocabulary chunks: the same tokens as one
    # program per row (Philox) and as the reference (explicit noise), bf16 logits included
    g = _gen(9)
    b = 6
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 0.5], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.02], device=DEVICE)
    top_k = torch.zeros(b, dtype=torch.int32, device=DEVICE)
    top_p = torch.ones(b, device=DEVICE)
    seeds, positions = torch.arange(b, device=DEVICE) + 7, torch.arange(b, device=DEVICE) * 5
    for dtype in (torch.float32, torch.bfloat16):
        logits = _logits(b, g).to(dtype)
        logits[4, 1500] = logits[4].max() + 3  # a greedy row whose argmax sits in the second chunk
        noise = torch.empty(b, V).exponential_(generator=g).to(DEVICE)
        ref = smp.sample_with_noise_ref(logits, temp, top_k, top_p, min_p, noise).tolist()
        one = smp.sample(logits, temp, top_k, top_p, min_p, seeds, positions).tolist()
        for chunks in (2, 1):  # V = 2000: chunks of 1024 tokens
            assert smp.sample_with_noise(logits, temp, top_k, top_p, min_p, noise, top_k_top_p=False,
                                         num_chunks=chunks).tolist() == ref
            assert smp.sample(logits, temp, top_k, top_p, min_p, seeds, positions, top_k_top_p=False,
                              num_chunks=chunks).tolist() == one
        assert ref[4] == 1500 and ref[0] == 17


def _sharded_calls(fn, shards: list[torch.Tensor], part: int, *args, **kwargs) -> list[list[int]]:
    """Each rank's call of a sharded sampler (fn(shard, vocab_start, vocab_size, ..., gather,
    ...)), the ranks in threads that meet in `gather` as a collective would. One thread runs at
    a time (the interpreter is not thread-safe): a rank hands over only while it waits there."""
    import threading
    world, turn, meet = len(shards), threading.Lock(), threading.Barrier(len(shards))
    slots: list = [None] * world
    outs: list = [None] * world

    def gather_of(rank):
        def gather(x):
            slots[rank] = x.clone()
            turn.release()
            meet.wait()              # every rank's part is in
            got = torch.cat(slots, dim=-1)
            meet.wait()              # every rank has read them before any writes its next
            turn.acquire()
            return got
        return gather

    def rank_main(rank):
        with turn:
            outs[rank] = fn(shards[rank], rank * part, args[0], *args[1:], gather_of(rank), **kwargs).tolist()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


@pytest.mark.parametrize("world,vocab", [(2, V), (3, V + 7)])
def test_sample_sharded_equals_the_whole_vocabulary(world, vocab):
    # tensor parallelism: plain rows drawn from every rank's vocabulary shard (the last padded)
    # through two exchanges give, on every rank, the tokens of the whole logits; with the
    # interpreter's Philox and with explicit noise; the shards start mid-chunk (V / 2 = 1000)
    g = _gen(21)
    b = 6
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 0.5], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.02], device=DEVICE)
    top_k, top_p = torch.zeros(b, dtype=torch.int32, device=DEVICE), torch.ones(b, device=DEVICE)
    seeds, positions = torch.arange(b, device=DEVICE) + 7, torch.arange(b, device=DEVICE) * 5
    part = -(-vocab // world)
    for dtype in (torch.float32, torch.bfloat16):
        logits = _randn(b, vocab, g=g, scale=3.0).to(dtype)
        logits[4, vocab - 3] = logits[4].max() + 3      # the last rank's greedy best
        logits[0, 5] = logits[0, part + 5] = logits[0].max() + 1  # a tie across ranks: the first wins
        noise = torch.empty(b, vocab).exponential_(generator=g).to(DEVICE)
        padded = torch.cat((logits, torch.zeros(b, part * world - vocab, dtype=dtype, device=DEVICE)), dim=1)
        shards = [padded[:, r * part:(r + 1) * part] for r in range(world)]
        args = (vocab, temp, min_p, seeds, positions)
        whole = {"noise": smp.sample_with_noise(logits, temp, top_k, top_p, min_p, noise, top_k_top_p=False),
                 "philox": smp.sample(logits, temp, top_k, top_p, min_p, seeds, positions, top_k_top_p=False)}
        assert whole["noise"].tolist() == smp.sample_with_noise_ref(logits, temp, top_k, top_p, min_p, noise).tolist()
        for chunks in (None, 1) if dtype == torch.float32 else (None,):   # (the split does not depend on it)
            got = _sharded_calls(smp.sample_sharded, shards, part, *args, world=world, noise=noise, num_chunks=chunks)
            assert got == [whole["noise"].tolist()] * world, chunks
            got = _sharded_calls(smp.sample_sharded, shards, part, *args, world=world, num_chunks=chunks)
            assert got == [whole["philox"].tolist()] * world, chunks
        ref = _sharded_calls(smp.sample_sharded_ref, shards, part, *args, noise=noise)
        assert ref == [whole["noise"].tolist()] * world
        seeded = smp.sample_ref(logits, temp, top_k, top_p, min_p, seeds, positions).tolist()
        assert _sharded_calls(smp.sample_sharded_ref, shards, part, *args) == [seeded] * world
        assert whole["noise"][4] == vocab - 3 and whole["noise"][0] == 5


def test_sample_respects_filters_and_is_seeded():
    g = _gen(7)
    temp, top_k, top_p, min_p = _sampling_params()
    b = temp.shape[0]
    logits = _logits(b, g, scale=2.0)
    allowed = _allowed_mask(logits, temp, top_k, top_p, min_p)
    assert allowed[2].sum() == 5 and allowed[6].sum() == 1
    seeds = torch.arange(100, 100 + b, device=DEVICE)
    positions = torch.arange(b, device=DEVICE) * 3
    outs = []
    for fn in (smp.sample, smp.sample_ref):
        out = fn(logits, temp, top_k, top_p, min_p, seeds, positions)
        assert all(allowed[i, t] for i, t in enumerate(out.tolist())), fn.__name__
        # same (seed, position) -> same token, whatever else is in the batch
        again = fn(logits, temp, top_k, top_p, min_p, seeds, positions)
        assert again.tolist() == out.tolist()
        rows = [3, 8, 4]
        sub = fn(logits[rows], temp[rows], top_k[rows], top_p[rows], min_p[rows], seeds[rows], positions[rows])
        assert sub.tolist() == [out[r].item() for r in rows]
        outs.append(out)
    # a different position draws different noise
    many = 6
    lg = logits[1:2].expand(many, V).contiguous()
    ones = torch.ones(many, device=DEVICE)
    toks = smp.sample(lg, ones, torch.zeros(many, dtype=torch.int32, device=DEVICE), ones,
                      torch.zeros(many, device=DEVICE), torch.full((many,), 5, device=DEVICE),
                      torch.arange(many, device=DEVICE))
    assert len(set(toks.tolist())) > 1


def test_sample_distribution():
    # Philox exponential race samples from softmax(logits / T) restricted to the kept set
    g = _gen(8)
    n, v = 64, 6
    logits = _randn(1, v, g=g).expand(n, v).contiguous()
    temp = torch.full((n,), 0.8, device=DEVICE)
    toks = smp.sample(logits, temp, torch.full((n,), 3, dtype=torch.int32, device=DEVICE),
                      torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE),
                      torch.full((n,), 1234, device=DEVICE), torch.arange(n, device=DEVICE))
    p = torch.softmax(logits[0].float().cpu() / 0.8, -1)
    top = torch.topk(p, 3).indices
    assert set(toks.tolist()) <= set(top.tolist())
    p_top = p[top] / p[top].sum()
    freq = torch.tensor([(toks.cpu() == t).float().mean().item() for t in top.tolist()])
    assert (freq - p_top).abs().max() < 0.2, (freq, p_top)


# --------------------------------------------------------------------------
# penalties
# --------------------------------------------------------------------------
def _penalty_case(g, vocab=3000, slots=6):
    """Rows: penalties with repeated output tokens and a long prompt; no output yet; bias +
    bans only; nothing; all of it; repetition alone on a row whose slot is reused."""
    counts = torch.zeros(slots, vocab, dtype=torch.int32)
    mask = torch.zeros(slots, vocab, dtype=torch.uint8)
    counts[0, torch.randint(0, vocab, (500,), generator=g)] += 1
    counts[0].index_add_(0, torch.tensor([5, 5, 5, vocab - 1]), torch.ones(4, dtype=torch.int32))  # repeats, last id
    mask[0, torch.randint(0, vocab, (2500,), generator=g)] = 1  # a prompt longer than the output
    mask[2, :40] = 1                                             # prompt only, empty output
    counts[4, 1000:1100] = 3
    mask[4, 1050:1200] = 1
    counts[5, 7] = 2
    return counts.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_match_ref(dtype):
    g = _gen(11)
    vocab = 3000
    counts, mask = _penalty_case(g, vocab)
    b = 6
    logits = _randn(b, vocab, g=g, scale=3.0).to(dtype)
    logits[:, 0] = 0.0  # l == 0 under the repetition penalty
    slots = torch.tensor([0, 2, 1, 3, 4, 5], device=DEVICE)
    rep = torch.tensor([1.3, 1.1, 1.0, 1.0, 0.8, 2.0], device=DEVICE)
    pres = torch.tensor([0.5, 0.0, 0.0, 0.0, -0.7, 0.0], device=DEVICE)
    freq = torch.tensor([0.25, 0.3, 0.0, 0.0, 1.5, 0.0], device=DEVICE)
    bias_ids = torch.full((b, 3), -1, dtype=torch.int32)
    bias_vals = torch.zeros(b, 3)
    bias_ids[2] = torch.tensor([9, 2500, 5000])  # an id past the vocabulary is ignored
    bias_vals[2] = torch.tensor([100.0, -100.0, 3.0])
    bias_ids[4, :2] = torch.tensor([1050, 5])
    bias_vals[4, :2] = torch.tensor([-2.5, 1.0])
    ban_ids = torch.full((b, 2), -1, dtype=torch.int32)
    ban_ids[2] = torch.tensor([3, 2999])
    ban_ids[4, 0] = 1060
    args = (logits, slots, counts, mask, rep, pres, freq, bias_ids.to(DEVICE), bias_vals.to(DEVICE), ban_ids.to(DEVICE))
    ref = pen.apply_penalties_ref(*args)
    for chunks in (None, 1, 3):
        out = pen.apply_penalties(*args, num_chunks=chunks)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
    # the reference against the rules written out, one row at a time
    lg = logits.float().cpu()
    for i in range(b):
        row, c, m = lg[i].clone(), counts[int(slots[i])].cpu(), mask[int(slots[i])].cpu().bool()
        for t, v in zip(bias_ids[i].tolist(), bias_vals[i].tolist()):
            if 0 <= t < vocab:
                row[t] += v
        r = float(rep[i])
        seen = m | (c > 0)
        row = torch.where(seen, torch.where(row > 0, row / r, row * r), row) if r != 1.0 else row
        row = row - float(freq[i]) * c.float() - float(pres[i]) * (c > 0).float()
        for t in ban_ids[i].tolist():
            if 0 <= t < vocab:
                row[t] = float("-inf")
        torch.testing.assert_close(ref[i].cpu(), row, atol=1e-5, rtol=1e-6)
    assert ref[2, 9] > 90 and ref[2, 2500] < -90 and ref[2, 3] == float("-inf") and ref[4, 1060] == float("-inf")
    assert torch.equal(ref[3].cpu(), lg[3])  # nothing asked: the logits as they were


def test_penalties_empty_sparse_inputs():
    g = _gen(12)
    counts, mask = _penalty_case(g)
    logits = _randn(2, 3000, g=g)
    none = torch.zeros(2, 0, dtype=torch.int32, device=DEVICE)
    args = (logits, torch.tensor([1, 0], device=DEVICE), counts, mask, torch.tensor([1.2, 1.0], device=DEVICE),
            torch.tensor([0.0, 0.4], device=DEVICE), torch.zeros(2, device=DEVICE), none, none.float(), none)
    torch.testing.assert_close(pen.apply_penalties(*args), pen.apply_penalties_ref(*args), atol=1e-5, rtol=1e-6)


# --------------------------------------------------------------------------
# GPU: real shapes, bf16
# --------------------------------------------------------------------------
@gpu
@needs_cuda
def test_gpu_real_shapes():
    from bench import kernels_gpu

    failures = kernels_gpu.check_all(quick=True)
    assert not failures, failures


@pytest.mark.parametrize("rot", [32, 16])
def test_apply_rotary_matches_hf(rot):
    """kernels/rotary_apply.py (the generic path's rotary, interpreted here) against HF's own
    apply_rotary_pos_emb: Llama's (full rotary) and GPT-NeoX's (partial)."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama
    torch.manual_seed(0)
    q = torch.randn(1, 5, 6, 32, device=DEVICE).transpose(1, 2)   # HF's [1, H, T, D] view
    k = torch.randn(1, 2, 5, 32, device=DEVICE)
    cos, sin = torch.randn(1, 5, rot, device=DEVICE), torch.randn(1, 5, rot, device=DEVICE)
    got = _mods["rotary_apply"].apply_rotary(q, k, cos, sin)
    for ref in ((llama,) if rot == 32 else ()) + (neox,):
        want = ref(q, k, cos, sin)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[0].transpose(1, 2).is_contiguous()   # laid out [1, T, H, D] for the attention kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_causal_split_long_prefill_tiles(dtype, monkeypatch):
    # the long-prefill path (CAUSAL_SPLIT: keys every row of a tile sees run unmasked, the diagonal
    # masked) at small tiles: prompts, chunks over earlier keys, a decode, GQA, split KV, NaN past
    # every length; exact to the reference as the masked loop is
    original = pa.tile_config
    # (the tiles in order, then in reverse; the order and the KV splits do not depend on the dtype)
    for heavy_first, splits in ((False, (2,)), (True, (1, 3))) if dtype == torch.float32 else ((True, (3,)),):
        monkeypatch.setattr(pa, "tile_config", lambda *a, _h=heavy_first: {
            **original(*a), "block_m": 16, "block_n": 16, "causal_split": True, "heavy_first": _h})
        _check_attention([40, 23, 1, 9], [40, 90, 57, 9], hq=4, hkv=2, d=32, bs=8, dtype=dtype, splits=splits)
    _check_attention([33], [161], hq=6, hkv=2, d=16, bs=16, dtype=dtype, splits=(None,), seed=2)
    # a mixed batch, decodes first: the prompt chunks' launch (a slice of the batch) in reverse order
    _check_attention([1, 1, 40, 23], [70, 9, 40, 90], hq=4, hkv=2, d=32, bs=8, dtype=dtype, splits=(None,),
                     num_decodes=2, seed=1)
    # soft cap and sinks (gpt-oss, Gemma 2), and an FP8 cache, through the mask-free loop too
    from kernels import kv_quant
    q_lens, seq_lens = [40, 23], [40, 90]
    q, kc, vc, qsl, sl, bt = _make_batch(q_lens, seq_lens, 4, 2, 32, 8, dtype, 4)
    sinks = _randn(4, dtype=torch.float32, g=_gen(5))
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.2, None, 3.0, sinks).float()
    out = pa.paged_attention(q, kc, vc, qsl, sl, bt, 0.2, 40, 90, logits_soft_cap=3.0, sinks=sinks)
    assert (out.float() - ref).abs().max().item() < (2e-5 if dtype == torch.float32 else 2e-2)
    k_scale, v_scale = (torch.tensor([x], device=DEVICE) for x in (0.02, 0.01))
    kc8 = kv_quant.quantize_fp8_ref(torch.nan_to_num(kc.float()) * 0.05, k_scale)
    vc8 = kv_quant.quantize_fp8_ref(torch.nan_to_num(vc.float()) * 0.02, v_scale)
    ref = pa.paged_attention_ref(q, kc8, vc8, qsl, sl, bt, 0.2, k_scale=k_scale, v_scale=v_scale).float()
    out = pa.paged_attention(q, kc8, vc8, qsl, sl, bt, 0.2, 40, 90, k_scale=k_scale, v_scale=v_scale)
    assert (out.float() - ref).abs().max().item() < (2e-5 if dtype == torch.float32 else 2e-2) * ref.abs().max()


def test_attention_long_prefill_rule(monkeypatch):
    # long tiles only for long prompt chunks over long contexts, never for decodes, short prompts or fp32
    long = pa.tile_config(2, 128, 8192, False, 1, 8.0, 16384)
    assert (long["block_m"], long["block_n"], long["num_warps"], long["num_stages"]) == (128, 64, 8, 3)
    assert long["causal_split"] and long["heavy_first"]
    for args in ((2, 128, 8192, False, 1, 1.5, 16384),    # too few programs for half as many long tiles
                 (2, 128, 1, False, 4, 0.5, 16384),      # decode at 16k
                 (2, 128, 1024, False, 1, 8.0, 1024),    # the standard workload's prompts
                 (2, 128, 8192, True, 1, 8.0, 16384),    # fp32
                 (2, 256, 8192, False, 1, 8.0, 16384)):  # head_dim 256
        assert not pa.tile_config(*args).get("causal_split"), args
    pa._long_prefill_setting.cache_clear()
    monkeypatch.setenv("LOOM_LONG_PREFILL_TILES", "off")
    try:
        assert not pa.tile_config(2, 128, 8192, False, 1, 8.0, 16384).get("causal_split")
        monkeypatch.setenv("LOOM_LONG_PREFILL_TILES", "64,128,4,2")
        pa._long_prefill_setting.cache_clear()
        got = pa.tile_config(2, 128, 8192, False, 1, 8.0, 16384)
        assert (got["block_m"], got["block_n"], got["num_warps"], got["num_stages"]) == (64, 128, 4, 2)
    finally:
        monkeypatch.delenv("LOOM_LONG_PREFILL_TILES")
        pa._long_prefill_setting.cache_clear()
