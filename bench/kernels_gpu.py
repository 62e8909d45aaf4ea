"""GPU check and micro-benchmark of the Triton kernels at real model shapes.

    export PYTHONPATH=$PWD; python3 -m bench.kernels_gpu [--quick]

For each kernel: compare with its torch reference in bf16 (sampling: fp32
logits) at Qwen3-0.6B / Llama-3.1-8B shapes, then time it with
triton.testing.do_bench and print ms and achieved GB/s (bytes that must move
at least once / time) against a ~4300 GB/s HBM floor (H200 copy bandwidth).
Exits non-zero if any check fails. `check_all(quick=True)` is the correctness
part alone at smaller shapes (used by tests/test_kernels.py on a GPU).
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from kernels import activation, paged_attention as pa, penalties, qk_rope_cache as qrc, rms_norm as rn, rotary, sampling

PEAK_GBS = 4300.0
BF16 = torch.bfloat16
MODELS = {
    "qwen3-0.6b": dict(hidden=1024, hq=16, hkv=8, d=128, inter=3072, vocab=151936),
    "llama3.1-8b": dict(hidden=4096, hq=32, hkv=8, d=128, inter=14336, vocab=128256),
}


class Ctx:
    def __init__(self, timing: bool):
        self.timing = timing
        self.failures: list[str] = []
        self.rows: list[tuple] = []
        self.top_p_rows: list[tuple] = []   # (model, B, logits, mode, {variant: ms}): the top_p part

    def check(self, name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0.0):
        got, want = got.float(), want.float()
        err = (got - want).abs()
        bad = err > atol + rtol * want.abs()
        status = "ok" if not bool(bad.any()) else "FAIL"
        msg = f"[{status}] {name}: max abs err {err.max().item():.3g}"
        print(msg, flush=True)
        if status != "ok":
            self.failures.append(msg)

    def expect(self, name: str, ok: bool, detail: str = ""):
        print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
        if not ok:
            self.failures.append(f"{name} {detail}")

    def bench(self, name: str, shape: str, fn, nbytes: float, flops: float = 0.0, ref_fn=None):
        if not self.timing:
            return
        ms = triton.testing.do_bench(fn, warmup=5, rep=30)
        ref_ms = triton.testing.do_bench(ref_fn, warmup=5, rep=30) if ref_fn is not None else float("nan")
        gbs = nbytes / ms / 1e6
        note = f"{flops / ms / 1e9:.0f} TFLOP/s" if flops else ""
        self.rows.append((name, shape, ms, gbs, 100.0 * gbs / PEAK_GBS, ref_ms, note))

    def table(self):
        if not self.rows:
            return
        print(f"\n{'kernel':<28} {'shape':<40} {'ms':>9} {'GB/s':>8} {'%4300':>6} {'torch ms':>9}  note")
        for name, shape, ms, gbs, pct, ref_ms, note in self.rows:
            ref = f"{ref_ms:9.4f}" if ref_ms == ref_ms else f"{'-':>9}"
            print(f"{name:<28} {shape:<40} {ms:9.4f} {gbs:8.0f} {pct:6.1f} {ref}  {note}")


def _paged_batch(q_lens, seq_lens, hq, hkv, d, block_size, dtype, dev, gen):
    n_blk = [(s + block_size - 1) // block_size for s in seq_lens]
    total = sum(n_blk) + 8
    kc = torch.randn(total, block_size, hkv, d, dtype=dtype, device=dev, generator=gen)
    vc = torch.randn(total, block_size, hkv, d, dtype=dtype, device=dev, generator=gen)
    perm = torch.randperm(total, device=dev, generator=gen).to(torch.int32)
    bt = torch.zeros(len(seq_lens), max(n_blk), dtype=torch.int32, device=dev)
    i = 0
    for b, n in enumerate(n_blk):
        bt[b, :n] = perm[i:i + n]
        i += n
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q = torch.randn(int(sum(q_lens)), hq, d, dtype=dtype, device=dev, generator=gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return q, kc, vc, qsl, sl, bt


def _attention(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
    scale = d ** -0.5
    if quick:
        cases = {
            "mixed": ([300, 1, 1, 40], [300, 900, 77, 1000], 0),
            "mixed, decodes first": ([1, 1, 300, 40], [900, 77, 300, 1000], 2),
            "decode-long": ([1, 1], [5000, 3000], 0),
        }
    else:
        cases = {
            "prefill 2x2048": ([2048, 2048], [2048, 2048], 0),
            "chunk 512 of 4096, x2": ([512, 512], [4096, 4096], 0),
            "mixed 1x1024+63 dec@2k": ([1024] + [1] * 63, [1024] + [2048] * 63, 0),
            "mixed 63 dec@2k+1x1024 hint": ([1] * 63 + [1024], [2048] * 63 + [1024], 63),
            "decode 64@4096": ([1] * 64, [4096] * 64, 0),
            "decode 256@1024": ([1] * 256, [1024] * 256, 0),
            "decode 2@32768": ([1, 1], [32768, 32768], 0),
        }
    for label, (q_lens, seq_lens, nd) in cases.items():
        q, kc, vc, qsl, sl, bt = _paged_batch(q_lens, seq_lens, hq, hkv, d, 16, BF16, dev, gen)
        args = (q, kc, vc, qsl, sl, bt, scale, max(q_lens), max(seq_lens))
        out = pa.paged_attention(*args, num_decodes=nd)
        ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale)
        ctx.check(f"paged_attention {model} {label}", out, ref, atol=1.5e-2, rtol=2e-2)
        splits = pa.choose_num_kv_splits(len(seq_lens), hkv, max(q_lens), max(seq_lens), q.device)
        if splits > 1:
            out1 = pa.paged_attention(*args, num_kv_splits=1)
            ctx.check(f"paged_attention {model} {label} (no split)", out1, ref, atol=1.5e-2, rtol=2e-2)
        kv_bytes = sum(seq_lens) * hkv * d * 2 * 2
        q_bytes = 2 * q.numel() * 2
        flops = sum(4 * ql * (s - ql / 2) * hq * d for ql, s in zip(q_lens, seq_lens))
        ctx.bench("paged_attention" + (f" split={splits}" if splits > 1 else ""),
                  f"{model} {label}", lambda: pa.paged_attention(*args, num_decodes=nd), kv_bytes + q_bytes, flops)
        if splits > 1:
            ctx.bench("paged_attention split=1", f"{model} {label}",
                      lambda: pa.paged_attention(*args, num_kv_splits=1), kv_bytes + q_bytes, flops)
        # Gemma 2's local layers: a window (4,096; 256 in --quick) and a soft cap of 50
        win = 256 if quick else 4096
        local = dict(num_decodes=nd, sliding_window=win, logits_soft_cap=50.0)
        ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale, win, 50.0)
        ctx.check(f"paged_attention {model} {label} window {win} cap 50", pa.paged_attention(*args, **local), ref,
                  atol=1.5e-2, rtol=2e-2)
        seen = [min(s, win + ql - 1) for ql, s in zip(q_lens, seq_lens)]   # keys a sequence's queries read
        ctx.bench(f"paged_attention window {win} cap 50", f"{model} {label}", lambda: pa.paged_attention(*args, **local),
                  sum(seen) * hkv * d * 2 * 2 + q_bytes,
                  sum(4 * ql * min(s - ql / 2, win) * hq * d for ql, s in zip(q_lens, seq_lens)))
        del q, kc, vc


def _norms(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    h, hq, d = cfg["hidden"], cfg["hq"], cfg["d"]
    t = 128 if quick else 8192
    x = torch.randn(t, h, dtype=BF16, device=dev, generator=gen)
    r = torch.randn(t, h, dtype=BF16, device=dev, generator=gen)
    w = torch.randn(h, dtype=BF16, device=dev, generator=gen)
    ctx.check(f"rms_norm {model}", rn.rms_norm(x, w, 1e-6), rn.rms_norm_ref(x, w, 1e-6), atol=2e-2, rtol=1e-2)
    o, nr = rn.fused_add_rms_norm(x, r, w, 1e-6)
    o_ref, nr_ref = rn.fused_add_rms_norm_ref(x, r, w, 1e-6)
    ctx.check(f"fused_add_rms_norm {model} (residual)", nr, nr_ref, atol=0.0)
    ctx.check(f"fused_add_rms_norm {model}", o, o_ref, atol=2e-2, rtol=1e-2)
    qh = torch.randn(t, hq, d, dtype=BF16, device=dev, generator=gen)
    wq = torch.randn(d, dtype=BF16, device=dev, generator=gen)
    ctx.check(f"rms_norm per-head {model}", rn.rms_norm(qh, wq, 1e-6), rn.rms_norm_ref(qh, wq, 1e-6),
              atol=2e-2, rtol=1e-2)
    n = x.numel() * 2
    ctx.bench("rms_norm", f"{model} [{t},{h}]", lambda: rn.rms_norm(x, w, 1e-6), 2 * n,
              ref_fn=lambda: rn.rms_norm_ref(x, w, 1e-6))
    ctx.bench("fused_add_rms_norm", f"{model} [{t},{h}]", lambda: rn.fused_add_rms_norm(x, r, w, 1e-6), 4 * n,
              ref_fn=lambda: rn.fused_add_rms_norm_ref(x, r, w, 1e-6))
    ctx.bench("rms_norm per-head (q)", f"{model} [{t},{hq},{d}]", lambda: rn.rms_norm(qh, wq, 1e-6),
              2 * qh.numel() * 2, ref_fn=lambda: rn.rms_norm_ref(qh, wq, 1e-6))


def _prologue(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    """q/k norm (Qwen3) + rotary + KV-cache write, fused, at decode and prefill token counts."""
    hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
    qwen = model.startswith("qwen")
    scaling = None if qwen else {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    cache = rotary.build_rope_cache(d, 32768, 500000.0, scaling, device=dev)
    # GPT-J style (interleaved pairs: GLM, Cohere) too, on the Llama shapes: the NEOX constexpr
    # picks the addressing, the NeoX rows must not move
    styles = [True] if qwen else [True, False]
    for t, neox in [(t, neox) for t in ([128] if quick else [1, 256, 8192]) for neox in styles]:
        name = model if neox else f"{model} gptj"
        qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=BF16, device=dev, generator=gen)
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        qw, kw = (torch.randn(d, dtype=BF16, device=dev, generator=gen) for _ in range(2)) if qwen else (None, None)
        pos = torch.randint(0, 32768, (t,), device=dev, generator=gen)
        nb, bs = (t // 16 + 1) * 2, 16
        slots = torch.randperm(nb * bs, device=dev, generator=gen)[:t]
        slots[1::17] = -1
        kc, vc = (torch.randn(nb, bs, hkv, d, dtype=BF16, device=dev, generator=gen) for _ in range(2))
        kc2, vc2 = kc.clone(), vc.clone()
        args = (pos, q, k, v, cache)
        out = qrc.qk_norm_rope_cache(*args, kc, vc, slots, qw, kw, 1e-6, is_neox_style=neox)
        ref = qrc.qk_norm_rope_cache_ref(*args, kc2, vc2, slots, qw, kw, 1e-6, is_neox_style=neox)
        ctx.check(f"qk_norm_rope_cache {name} T={t} q", out, ref, atol=2e-2, rtol=1e-2)
        ctx.check(f"qk_norm_rope_cache {name} T={t} k cache", kc, kc2, atol=2e-2, rtol=1e-2)
        ctx.expect(f"qk_norm_rope_cache {name} T={t} v cache", torch.equal(vc, vc2))
        nbytes = 2 * qkv.numel() * 2 - 2 * t * hkv * d * 2 + t * d * 4  # read qkv, write q + k + v, cos/sin
        ctx.bench("qk_norm_rope_cache", f"{name} T={t}", lambda: qrc.qk_norm_rope_cache(
            *args, kc, vc, slots, qw, kw, 1e-6, is_neox_style=neox), nbytes,
            ref_fn=lambda: qrc.qk_norm_rope_cache_ref(*args, kc2, vc2, slots, qw, kw, 1e-6, is_neox_style=neox))


def _silu(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    i = cfg["inter"]
    t = 64 if quick else 4096
    x = torch.randn(t, 2 * i, dtype=BF16, device=dev, generator=gen)
    ctx.check(f"silu_and_mul {model}", activation.silu_and_mul(x), activation.silu_and_mul_ref(x),
              atol=2e-2, rtol=1e-2)
    ctx.bench("silu_and_mul", f"{model} [{t},{2 * i}]", lambda: activation.silu_and_mul(x),
              x.numel() * 2 * 3 // 2, ref_fn=lambda: activation.silu_and_mul_ref(x))


def _sampling(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    vocab = cfg["vocab"]
    b = 16 if quick else 64
    logits = torch.randn(b, vocab, device=dev, generator=gen) * 4.0
    ones = torch.ones(b, device=dev)
    zeros_i = torch.zeros(b, dtype=torch.int32, device=dev)
    seeds = torch.arange(b, device=dev)
    pos = torch.arange(b, device=dev) + 1000
    configs = {
        "greedy": (ones * 0, zeros_i, ones, ones * 0),
        "temp only": (ones * 0.8, zeros_i, ones, ones * 0),
        "top_k=50 top_p=0.9": (ones * 0.7, zeros_i + 50, ones * 0.9, ones * 0),
        "top_p=0.95": (ones, zeros_i, ones * 0.95, ones * 0),
        "mixed rows": (torch.rand(b, device=dev, generator=gen) * 1.5,
                       torch.randint(0, 100, (b,), dtype=torch.int32, device=dev, generator=gen),
                       torch.rand(b, device=dev, generator=gen) * 0.5 + 0.5,
                       (torch.rand(b, device=dev, generator=gen) < 0.3) * 0.05),
    }
    for label, (temp, top_k, top_p, min_p) in configs.items():
        noise = torch.empty(b, vocab, device=dev).exponential_(generator=gen)
        got = sampling.sample_with_noise(logits, temp, top_k, top_p, min_p, noise)
        want = sampling.sample_with_noise_ref(logits, temp, top_k, top_p, min_p, noise)
        same = int((got == want).sum())
        # exp/div differ by an ulp between Triton and torch on GPU: allow a rare borderline flip
        ctx.expect(f"sample_with_noise {model} {label}", same >= b - max(1, b // 32), f"({same}/{b} identical)")
        s1 = sampling.sample(logits, temp, top_k, top_p, min_p, seeds, pos)
        s2 = sampling.sample(logits, temp, top_k, top_p, min_p, seeds, pos)
        ctx.expect(f"sample {model} {label} reproducible", torch.equal(s1, s2))
        # GB/s counts one read of the logits; the kernel makes several passes over each row
        ctx.bench("sample", f"{model} B={b} {label}",
                  lambda: sampling.sample(logits, temp, top_k, top_p, min_p, seeds, pos), logits.numel() * 4)
        kmax = int(top_k.max())
        p_only = bool(((top_k <= 0) & (top_p < 1)).any())
        if kmax > 0 or p_only:  # rows with top-k (or top-p alone) draw from one torch.topk's candidates
            # (top-p sums the mass in another order: allow a rare borderline flip, as above)
            cand = dict(max_top_k=kmax, top_p_only=p_only)
            for name, x, y in (("sample", sampling.sample(logits, temp, top_k, top_p, min_p, seeds, pos, **cand), s1),
                               ("sample_with_noise", sampling.sample_with_noise(logits, temp, top_k, top_p, min_p,
                                                                                noise, **cand), got)):
                same = int((x == y).sum())
                ctx.expect(f"{name} {model} {label} candidates == passes", same >= b - max(1, b // 32),
                           f"({same}/{b} identical)")
            for rows in ([b, 256] if ctx.timing else []):
                lg = logits[:1].expand(rows, vocab).contiguous().to(torch.bfloat16)
                args = tuple(x[:1].expand(rows).contiguous() for x in (temp, top_k, top_p, min_p)) + (
                    torch.arange(rows, device=dev), torch.arange(rows, device=dev))
                for c in ({}, cand):
                    ctx.bench("sample" + (" candidates" if c else ""), f"{model} B={rows} bf16 {label}",
                              lambda: sampling.sample(lg, *args, **c), lg.numel() * 2)
        if not bool(((top_k > 0) | (top_p < 1)).any()):  # rows split over vocabulary chunks
            chunked = sampling.sample(logits, temp, top_k, top_p, min_p, seeds, pos, top_k_top_p=False)
            ctx.expect(f"sample {model} {label} chunked == per row", torch.equal(chunked, s1))
            for rows in ([1, b, 256] if ctx.timing else []):
                lg = logits[:1].expand(rows, vocab).contiguous()
                args = (temp[:1].expand(rows).contiguous(), top_k[:1].expand(rows).contiguous(),
                        top_p[:1].expand(rows).contiguous(), min_p[:1].expand(rows).contiguous(),
                        torch.arange(rows, device=dev), torch.arange(rows, device=dev))
                for flag in (True, False):
                    ctx.bench("sample" + ("" if flag else " chunked"), f"{model} B={rows} {label}",
                              lambda: sampling.sample(lg, *args, top_k_top_p=flag), lg.numel() * 4)


def _penalties(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    """Repetition + presence + frequency penalties, logit_bias and bans on every row (bf16 logits)."""
    vocab = cfg["vocab"]
    b = 16 if quick else 256
    logits = (torch.randn(b, vocab, device=dev, generator=gen) * 4.0).to(torch.bfloat16)
    counts = torch.zeros(b, vocab, dtype=torch.int32, device=dev)
    counts.scatter_add_(1, torch.randint(0, vocab, (b, 300), device=dev, generator=gen),
                        torch.ones(b, 300, dtype=torch.int32, device=dev))
    mask = (torch.rand(b, vocab, device=dev, generator=gen) < 0.005).to(torch.uint8)
    slots = torch.randperm(b, device=dev, generator=gen)
    f = lambda x: torch.full((b,), x, device=dev)
    bias_ids = torch.randint(0, vocab, (b, 4), dtype=torch.int32, device=dev, generator=gen)
    args = (logits, slots, counts, mask, f(1.1), f(0.5), f(0.2), bias_ids, torch.ones(b, 4, device=dev),
            torch.randint(0, vocab, (b, 2), dtype=torch.int32, device=dev, generator=gen))
    out, ref = penalties.apply_penalties(*args), penalties.apply_penalties_ref(*args)
    err = (out - ref).abs().nan_to_num(0.0).max().item()
    ctx.expect(f"apply_penalties {model} B={b}", err < 1e-5 and torch.equal(out.isinf(), ref.isinf()),
               f"(max err {err:.2e})")
    ctx.bench("apply_penalties", f"{model} B={b}", lambda: penalties.apply_penalties(*args),
              logits.numel() * (2 + 4 + 4 + 1), ref_fn=lambda: penalties.apply_penalties_ref(*args))


def _logprobs(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    """The sampler's logprobs=5 tail (log-softmax, the sampled token's logprob and rank, top-5) on
    bf16 logits: checked against torch on the same logits, and the whole Sampler call timed with
    and without it (the difference is what logprobs cost the device per step)."""
    from ipc.sampling_params import SamplingParams
    from workers.host_to_device import map_arrays
    from workers.sampler import Sampler, SamplingRow
    vocab = cfg["vocab"]
    for b in ((16,) if quick else (256, 128)):
        logits = (torch.randn(b, vocab, device=dev, generator=gen) * 4.0).to(BF16)
        sampler = Sampler(use_triton=dev.type == "cuda")
        for n in (None, 5):
            rows = [SamplingRow(SamplingParams(temperature=0.6, logprobs=n), seed=i, output_index=7, slot=i)
                    for i in range(b)]
            d = map_arrays(Sampler.host_params(rows), lambda a: torch.from_numpy(a).to(dev))
            tokens, topk, *_ = sampler(logits, rows, d)
            if n is not None:
                ids, lps, ranks = topk
                ref = torch.log_softmax(logits.float(), dim=-1)
                ok = (torch.equal(ids[:, 0], tokens) and torch.equal(lps, ref.gather(1, ids))
                      and torch.equal(ranks, (ref > ref.gather(1, tokens[:, None])).sum(-1) + 1)
                      and torch.equal(ref.gather(1, ids[:, 1:]), ref.topk(n, dim=-1).values))
                ctx.expect(f"sampler logprobs=5 {model} B={b}", ok)
            ctx.bench("sampler" + (" logprobs=5" if n else ""), f"{model} B={b} bf16 t=0.6",
                      lambda: sampler(logits, rows, d), logits.numel() * 2)


def _graphed(fn):
    """fn captured in a CUDA graph (after a warm-up run on a side stream): its replay, the device
    time alone, as the decode graphs' head runs the sampler."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# the top-p route's variants, side by side: LOOM_TOP_P_RACE_CHUNKS (the second race's split)
TOP_P_VARIANTS = {"old": "0", "new": "16"}


def _top_p(ctx: Ctx, model: str, cfg: dict, quick: bool, dev, gen):
    """Issue 49: top-p without top-k (the race winner's check), with penalties, and top-p + top-k,
    against plain temperature, through the Sampler as the engine calls it (bf16 logits; flat rows
    as random weights give, peaked rows as a trained model's). Seeded tokens equal the reference
    on the same Philox noise (philox_noise), but for a rare ulp-borderline flip (GPU division).
    Timed eagerly (host launches included) and captured in a CUDA graph (the device time alone),
    for each TOP_P_VARIANTS setting: ctx.top_p_rows, printed as one table by top_p_table()."""
    import os

    from ipc.sampling_params import SamplingParams
    from workers.host_to_device import map_arrays
    from workers.sampler import Sampler, SamplingRow
    vocab = cfg["vocab"]
    sampler = Sampler(use_triton=dev.type == "cuda")
    modes = {"plain": {}, "top_p=0.95": dict(top_p=0.95),
             "top_p=0.95 rep 1.1 pres 0.5": dict(top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5),
             "top_p=0.9 top_k=50": dict(top_p=0.9, top_k=50)}
    try:   # (each variant sets LOOM_TOP_P_RACE_CHUNKS; unset afterwards: the default again)
        for b in ((16,) if quick else (1, 64, 256)):
            counts = torch.zeros(b, vocab, dtype=torch.int32, device=dev)
            counts.scatter_add_(1, torch.randint(0, vocab, (b, 300), device=dev, generator=gen),
                                torch.ones(b, 300, dtype=torch.int32, device=dev))
            state = (counts, (torch.rand(b, vocab, device=dev, generator=gen) < 0.003).to(torch.uint8))
            for shape, scale in (("flat", 0.5), ("peaked", 4.0)):
                logits = (torch.randn(b, vocab, device=dev, generator=gen) * scale).to(torch.bfloat16)
                for label, kw in modes.items():
                    rows = [SamplingRow(SamplingParams(temperature=0.8, **kw), seed=i, output_index=7, slot=i)
                            for i in range(b)]
                    d = map_arrays(Sampler.host_params(rows), lambda a: torch.from_numpy(a).to(dev))
                    times = {}
                    want = None if any(r.adjusts for r in rows) else sampling.sample_with_noise_ref(
                        logits, d.temperature, d.top_k, d.top_p, d.min_p,
                        sampling.philox_noise(d.seeds, d.output_indices, vocab))
                    for variant, value in TOP_P_VARIANTS.items():
                        os.environ["LOOM_TOP_P_RACE_CHUNKS"] = value
                        tokens = sampler(logits, rows, d, state).tokens
                        if want is not None:
                            same = int((tokens == want).sum())
                            ctx.expect(f"sampler {model} B={b} {shape} {label} ({variant}) == reference",
                                       same >= b - max(1, b // 32), f"({same}/{b} identical)")
                        if ctx.timing:
                            call = lambda: sampler(logits, rows, d, state)   # noqa: E731
                            times[f"graph {variant}"] = triton.testing.do_bench(_graphed(call), warmup=5, rep=30)
                            if variant == "new":
                                times["eager"] = triton.testing.do_bench(call, warmup=5, rep=30)
                    if times:
                        ctx.top_p_rows.append((model, b, shape, label, times))
    finally:
        os.environ.pop("LOOM_TOP_P_RACE_CHUNKS", None)


def top_p_table(rows: list[tuple]) -> list[dict]:
    """The top_p part's times as one table (device ms per call, graphed old / new, eager new, and
    the new graph's ratio to plain's at the same shape); returns the rows as dicts (JSON)."""
    plain = {(m, b, s): t["graph new"] for m, b, s, label, t in rows if label == "plain"}
    print(f"\n{'sampler device ms per call':<28} {'B':>4} {'logits':<7} {'mode':<28} {'graph old':>9} "
          f"{'graph new':>9} {'eager new':>9} {'new/plain':>9}")
    out = []
    for m, b, s, label, t in rows:
        ratio = t["graph new"] / plain[m, b, s] if (m, b, s) in plain else float("nan")
        print(f"{m:<28} {b:>4} {s:<7} {label:<28} {t['graph old']:9.4f} {t['graph new']:9.4f} "
              f"{t['eager']:9.4f} {ratio:9.2f}")
        out.append(dict(model=m, batch=b, logits=s, mode=label, graph_old_ms=t["graph old"],
                        graph_new_ms=t["graph new"], eager_new_ms=t["eager"], new_over_plain=ratio))
    return out


PARTS = {"prologue": _prologue, "norms": _norms, "silu": _silu, "sampling": _sampling, "logprobs": _logprobs,
         "penalties": _penalties, "attention": _attention, "top_p": _top_p}


def run(quick: bool, timing: bool, device: str = "cuda", parts: list[str] | None = None) -> Ctx:
    dev = torch.device(device)
    assert dev.type != "cuda" or torch.cuda.is_available(), "needs a CUDA GPU"
    ctx = Ctx(timing and dev.type == "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for model, cfg in MODELS.items():
        for part in (PARTS[p] for p in parts or PARTS):
            try:
                part(ctx, model, cfg, quick, dev, gen)
            except Exception as exc:  # keep going: report every kernel
                import traceback
                traceback.print_exc()
                ctx.failures.append(f"{part.__name__} {model}: {type(exc).__name__}: {exc}")
            if dev.type == "cuda":
                torch.cuda.synchronize()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return ctx


def check_all(quick: bool = True) -> list[str]:
    return run(quick=quick, timing=False).failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes, correctness only")
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=None, help="only these kernels (default: all)")
    ap.add_argument("--output-json", default=None, help="write the top_p part's table to this JSON file")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    ctx = run(quick=args.quick, timing=not args.quick, parts=args.parts)
    ctx.table()
    if ctx.top_p_rows:
        table = top_p_table(ctx.top_p_rows)
        if args.output_json:
            import json
            with open(args.output_json, "w") as f:
                json.dump(table, f, indent=1)
    if ctx.failures:
        print(f"\n{len(ctx.failures)} FAILED:\n  " + "\n  ".join(ctx.failures))
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
