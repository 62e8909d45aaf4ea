"""Sweep the paged-attention launch parameters on the GPU (tiles, warps, stages,
KV splits) over decode and prefill shapes; print each shape's fastest configs
beside today's default. The numbers behind kernels/paged_attention.py's
tile_config and choose_num_kv_splits.

    export PYTHONPATH=$PWD; python3 -m bench.tune_attention [--quick | --trajectory | --trajectory-sweep]

Each variant is timed as a CUDA-graph replay (do_bench_cudagraph), as decode
runs in the engine, and checked against the torch reference once.
"""
from __future__ import annotations

import argparse
import itertools
import random
import time

import torch
import triton

from bench.kernels_gpu import _paged_batch
from bench.workloads import Workload, offline_workload
from kernels import paged_attention as pa
from kernels.jit import sm_count

# (q heads, kv heads, head dim) of one rank
SHAPES = {"qwen3": (16, 8, 128), "llama8b": (32, 8, 128), "qwen3-8b-tp2": (16, 4, 128),
          "llama70b-tp2": (32, 4, 128), "qwen2.5-7b": (28, 4, 128)}


def _time(fn) -> float:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=30)
    except Exception:  # older triton / a kernel that cannot be captured
        return triton.testing.do_bench(fn, warmup=5, rep=30)


def sweep(label: str, model: str, q_lens, seq_lens, grid: list[dict], top: int, gen) -> None:
    hq, hkv, d = SHAPES[model]
    q, kc, vc, qsl, sl, bt = _paged_batch(q_lens, seq_lens, hq, hkv, d, 16, torch.bfloat16, "cuda", gen)
    order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
    args = (q, kc, vc, qsl, sl, bt, d ** -0.5, max(q_lens), max(seq_lens))
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, d ** -0.5).float()
    kv_bytes = sum(seq_lens) * hkv * d * 2 * 2
    default_splits = pa.choose_num_kv_splits(len(seq_lens), hkv, max(q_lens), max(seq_lens), q.device)
    original = pa.tile_config
    rows = []
    t0 = time.perf_counter()
    try:
        for cfg in grid:
            splits = cfg.get("splits", default_splits)
            tiles = {k: v for k, v in cfg.items() if k not in ("splits", "ordered")}
            pa.tile_config = lambda *a, _t=tiles: {**original(*a), **_t}
            so = order if cfg.get("ordered") else None
            fn = lambda: pa.paged_attention(*args, num_kv_splits=splits, seq_order=so)  # noqa: E731
            try:
                err = (fn().float() - ref).abs().max().item()
                ms = _time(fn)
            except Exception as exc:  # e.g. out of shared memory
                print(f"  {label} {cfg}: {type(exc).__name__}", flush=True)
                continue
            rows.append((ms, splits, {**tiles, **({"ordered": True} if so is not None else {})}, err))
    finally:
        pa.tile_config = original
    # a pure decode step runs longest first in the engine (seq_order), so its default does too
    default_order = order if max(q_lens) == 1 else None
    default = _time(lambda: pa.paged_attention(*args, seq_order=default_order))
    rows.sort(key=lambda r: r[0])
    default_tiles = original(hq // hkv, d, max(q_lens), False, default_splits, len(seq_lens) * hkv / sm_count(q.device))
    print(f"\n== {model} {label}: default {default * 1e3:.1f} us (splits {default_splits}, {default_tiles}), "
          f"KV floor {kv_bytes / 4.3e12 * 1e6:.1f} us; {len(grid)} variants in {time.perf_counter() - t0:.0f} s",
          flush=True)
    for ms, splits, tiles, err in rows[:top]:
        print(f"  {ms * 1e3:8.1f} us  splits={splits:<3d} {tiles}  err {err:.3g}", flush=True)
    del q, kc, vc


def _grid(**axes) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())]


def main() -> int:
    ap = argparse.ArgumentParser(description="Time decode and prefill attention tilings on the GPU.")
    ap.add_argument("--quick", action="store_true", help="every 7th decode tiling only (a smoke run)")
    ap.add_argument("--top", type=int, default=6, help="the fastest configurations printed per shape (default 6)")
    ap.add_argument("--mixed", type=int, nargs="*", metavar="BATCH",
                    help="only decode batches of these sizes (default 64 128 256) with the offline "
                         "workload's mixed context lengths")
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["qwen3", "llama8b"],
                    help="the rank shapes --mixed sweeps (default qwen3 llama8b)")
    ap.add_argument("--trajectory", type=int, nargs="?", const=32, metavar="EVERY",
                    help="today's defaults at every EVERY-th decode step (default 32) of the offline workload "
                         "and of each DP=2 engine's half (bench throughput --shard 0/2, 1/2): attention time "
                         "per layer over the run")
    ap.add_argument("--trajectory-sweep", action="store_true",
                    help="sweep split counts and tiles at the late, small decode batches of the offline "
                         "workload and its halves, where split-KV decides")
    ap.add_argument("--decode", nargs="+", metavar="MODEL:BATCHxCONTEXT",
                    help="only these decode batches (e.g. qwen2.5-7b:32x2200: 32 decodes of 2,200 keys, "
                         "longest first as in the engine), over splits, tiles, warps and stages")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    if args.decode:
        return decode_shapes(args.top, gen, args.decode)
    if args.mixed is not None:
        return mixed(args.top, gen, args.mixed or (64, 128, 256), args.models)
    if args.trajectory is not None:
        return trajectory(gen, args.trajectory)
    if args.trajectory_sweep:
        return trajectory_sweep(gen, args.top)
    decode = _grid(splits=[1, 4, 8, 16, 32], block_n=[16, 32, 64], num_warps=[2, 4], num_stages=[1, 3])
    if args.quick:
        decode = decode[::7]
    for model, ctx in [("qwen3", 1024), ("qwen3", 256), ("llama8b", 1024), ("qwen3", 4096)]:
        sweep(f"decode 1@{ctx}", model, [1], [ctx], decode, args.top, gen)
    mid = _grid(splits=[1, 2, 4], block_n=[32, 64], num_warps=[2, 4], num_stages=[2, 3])
    for model, bs in [("qwen3", 16), ("qwen3", 64)]:
        sweep(f"decode {bs}@1024", model, [1] * bs, [1024] * bs, mid, args.top, gen)
    sweep("decode 256@1024", "qwen3", [1] * 256, [1024] * 256,
          _grid(splits=[1], block_n=[32, 64, 128], num_warps=[2, 4, 8], num_stages=[2, 3, 4]), args.top, gen)
    prefill = _grid(block_m=[64, 128], block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3])
    for model in ("qwen3", "llama8b"):
        sweep("prefill 8x1024", model, [1024] * 8, [1024] * 8, prefill, args.top, gen)
    return 0


def decode_batch(workload: Workload, step: int) -> list[int]:
    """The context lengths of the decode batch at decode step `step` of a workload run alone
    (every request admitted at once, as the offline workload's 256 are)."""
    return [len(p) + step + 1 for p, m in zip(workload.prompts, workload.max_tokens) if m > step]


def trajectory(gen, every: int) -> int:
    """Attention with today's defaults over a run's decode steps, per layer (Qwen3-0.6B's heads):
    the whole offline workload, then each half that an engine of DP=2 gets."""
    hq, hkv, d = SHAPES["qwen3"]
    whole = offline_workload()
    for name, workload in (("whole", whole), ("shard 0/2", whole.shard(0, 2)), ("shard 1/2", whole.shard(1, 2))):
        total_ms = total_bytes = 0.0
        steps = max(workload.max_tokens)
        for step in range(0, steps, every):
            lens = decode_batch(workload, step)
            q, kc, vc, qsl, sl, bt = _paged_batch([1] * len(lens), lens, hq, hkv, d, 16, torch.bfloat16, "cuda", gen)
            order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
            weight = min(every, steps - step)
            total_ms += weight * _time(lambda: pa.paged_attention(q, kc, vc, qsl, sl, bt, d ** -0.5, 1, max(lens),
                                                                  seq_order=order))
            total_bytes += weight * sum(lens) * hkv * d * 2 * 2
            q = kc = vc = None   # free them before the next shape
        print(f"{name}: {total_ms:.1f} ms per layer over {steps} decode steps "
              f"({total_bytes / total_ms / 1e9:.2f} TB/s)", flush=True)
    return 0


def trajectory_sweep(gen, top: int) -> int:
    """Split counts and tiles at the late, small decode batches of the offline workload and of
    DP=2's first half, where split-KV decides."""
    grid = _grid(ordered=[True], splits=[1, 2, 4, 8, 16], block_n=[64, 128], num_warps=[4], num_stages=[1, 2, 3])
    whole = offline_workload()
    halves = {"whole": whole, "shard 0/2": whole.shard(0, 2)}
    for name, step in [("shard 0/2", t) for t in (384, 512, 640, 704, 768, 832, 896, 960, 1000)] + \
                      [("whole", t) for t in (768, 832, 896, 960, 1000)]:
        lens = decode_batch(halves[name], step)
        sweep(f"{name} step {step}: decode {len(lens)}", "qwen3", [1] * len(lens), lens, grid, top, gen)
    return 0


def mixed(top: int, gen, sizes=(64, 128, 256), models=("qwen3", "llama8b")) -> int:
    """Decode batches whose contexts spread as the offline workload's do (prompt
    100-1024 tokens plus up to 1024 generated): random order against longest first."""
    rng = random.Random(0)
    grid = (_grid(ordered=[False, True], splits=[1], block_n=[64, 128], num_warps=[4, 8], num_stages=[2, 3, 4])
            + _grid(ordered=[False, True], splits=[2, 4], block_n=[64, 128], num_warps=[4, 8], num_stages=[1, 2, 3]))
    for model in models:
        for bs in sizes:
            lens = [rng.randint(101, 2048) for _ in range(bs)]
            sweep(f"decode {bs}@mixed (mean {sum(lens) // bs})", model, [1] * bs, lens, grid, top, gen)
    return 0


def decode_shapes(top: int, gen, specs: list[str]) -> int:
    """Decode batches of one context length per spec (MODEL:BATCHxCONTEXT)."""
    grid = _grid(ordered=[True], splits=[1, 2, 4, 8, 16], block_n=[64, 128], num_warps=[4, 8], num_stages=[1, 2, 3])
    for spec in specs:
        model, shape = spec.split(":")
        batch, ctx = (int(x) for x in shape.split("x"))
        sweep(f"decode {batch}@{ctx}", model, [1] * batch, [ctx] * batch, grid, top, gen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
