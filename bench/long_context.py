"""Long context (issue 49 item 3): paged attention at 16k keys, per kernel, with its floor beside
it, for the default launch and variants side by side; then the end-to-end table.

    export PYTHONPATH=$PWD
    python3 -m bench.long_context --output-json $OUT/long-kernels.json     # the kernel rows (~1 min)
    python3 -m bench.long_context --summary $OUT                           # + the end-to-end runs' JSON

Kernel rows (Qwen3-0.6B's heads: 16 query heads, 8 KV heads, head_dim 128; bf16; 16-token pages
in shuffled blocks, as the engine's cache):
  - prefill: one 8,192-token chunk at 0 and at 8,192 earlier keys, and a whole 16,384-token
    prompt in one launch. Floor: its FLOPs (4 x visible (query, key) pairs x head_dim x 16
    heads: QK^T and PV, masked pairs not counted) at the H200's 990 TFLOP/s dense bf16 peak.
    Variants: the long-prefill tiles (BLOCK_M,BLOCK_N,WARPS,STAGES, all with the causal split:
    kernels/paged_attention.py long_prefill_tiles) and `short`, the tiles of the standard
    workload without the split (what ran before: LOOM_LONG_PREFILL_TILES=off).
  - decode: 16 sequences x 16,384 keys, one layer, as the decode graph runs it (max_seq_len =
    max_model_len 16,640, the decode order, a CUDA-graph replay). Floor: its K and V bytes at
    4.3 TB/s (16 x 16,384 x 8 heads x 128 x 2 (K, V) x 2 bytes = 1.07 GB: 250 us). Variants:
    KV splits and tiles.

The end-to-end floor (the issue's): prefill attention FLOPs at half of peak (what an FA2-style
kernel reaches on Hopper, about 1.0 s) + the decode steps' KV reads at 4.3 TB/s (1.8 s); the
target is 75% of it, 3.7 s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HQ, HKV, D, BS = 16, 8, 128, 16   # Qwen3-0.6B's attention, the engine's block size
LAYERS = 28
PEAK_FLOPS = 990e12               # H200 dense bf16
HBM_BYTES_PER_S = 4.3e12          # what decode reaches of the H200's 4.8 TB/s
NUM_SEQS, PROMPT, OUT_LEN, MAX_MODEL_LEN = 16, 16384, 256, 16640
E2E_TARGET_S = 3.7

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the long-prefill tiles (None: the short tiles, no causal
# split: before), and tile_config overrides
PREFILL_VARIANTS = {"short (before)": (None, {}), "128x64 w8 s3": ((128, 64, 8, 3), {}),
                    "128x64 w8 s3 in order": ((128, 64, 8, 3), {"heavy_first": False}),
                    "128x64 w8 s3 masked": ((128, 64, 8, 3), {"causal_split": False}),
                    "128x128 w8 s2": ((128, 128, 8, 2), {}), "128x64 w8 s4": ((128, 64, 8, 4), {}),
                    "128x64 w4 s3": ((128, 64, 4, 3), {}), "64x64 w4 s3": ((64, 64, 4, 3), {}),
                    "128x32 w4 s4": ((128, 32, 4, 4), {})}
# (splits or None for the default, tile overrides)
DECODE_VARIANTS = {"default": (None, {}), "2 splits": (2, {}), "8 splits": (8, {}), "16 splits": (16, {}),
                   "8 splits n64 s3": (8, {"block_n": 64, "num_stages": 3}),
                   "8 splits n128 s3": (8, {"block_n": 128, "num_stages": 3}),
                   "4 splits n128 s3": (4, {"block_n": 128, "num_stages": 3}),
                   "4 splits n64 s4": (4, {"block_n": 64, "num_stages": 4}),
                   # 64-key tiles 2 deep: 64 KB of shared memory, 3 programs per SM where 128 keys 2 deep fit one
                   "4 splits n64 s2": (4, {"block_n": 64, "num_stages": 2}),
                   "8 splits n64 s2": (8, {"block_n": 64, "num_stages": 2}),
                   "16 splits n64 s2": (16, {"block_n": 64, "num_stages": 2})}


def prefill_flops(q_len: int, seq_len: int) -> float:
    """QK^T and PV over the visible (query, key) pairs of q_len queries ending a seq_len context."""
    ctx = seq_len - q_len
    pairs = q_len * ctx + q_len * (q_len + 1) / 2
    return 4.0 * pairs * D * HQ


def decode_bytes(num_seqs: int, keys: int) -> float:
    return num_seqs * keys * HKV * D * 2 * 2


def e2e_floor_s() -> tuple[float, float]:
    """(prefill attention at half of peak, decode KV reads at 4.3 TB/s), the whole run's, in s."""
    prefill = NUM_SEQS * LAYERS * prefill_flops(PROMPT, PROMPT) / (0.5 * PEAK_FLOPS)
    kv = sum(decode_bytes(NUM_SEQS, PROMPT + i) for i in range(OUT_LEN)) * LAYERS / HBM_BYTES_PER_S
    return prefill, kv


def _time_ms(fn, graph: bool) -> float:
    import triton
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=50)
        except Exception:   # (a Triton without it)
            pass
    return triton.testing.do_bench(fn, warmup=5, rep=50)


def kernel_rows(quick: bool, output_json: str | None = None) -> list[dict]:
    """The kernel rows, each printed and (with output_json) written as it comes: a run cut short
    by the suite's timeout keeps the rows it has."""
    import torch

    from bench.kernels_gpu import _paged_batch
    from kernels import paged_attention as pa

    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = D ** -0.5
    rows: list[dict] = []
    setting, tile_config = pa._long_prefill_setting, pa.tile_config
    cases = [("prefill chunk 8,192 @ 0 keys", 8192, 8192), ("prefill chunk 8,192 @ 8,192 keys", 8192, 16384),
             ("prefill 16,384 whole (1 seq)", 16384, 16384)]
    variants = dict(list(PREFILL_VARIANTS.items())[:3]) if quick else PREFILL_VARIANTS
    default_tiles = setting()
    try:
        for label, q_len, seq_len in cases:
            q, kc, vc, qsl, sl, bt = _paged_batch([q_len], [seq_len], HQ, HKV, D, BS, torch.bfloat16, "cuda", gen)
            ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale).float()
            flops = prefill_flops(q_len, seq_len)
            for name, (tiles, extra) in variants.items():
                pa._long_prefill_setting = lambda _t=tiles: _t
                pa.tile_config = lambda *a, _x=extra: {**tile_config(*a), **_x}
                fn = lambda: pa.paged_attention(q, kc, vc, qsl, sl, bt, scale, q_len, seq_len)  # noqa: E731
                try:
                    err = (fn().float() - ref).abs().max().item()
                    ms = _time_ms(fn, graph=False)
                except Exception as exc:   # e.g. out of shared memory
                    print(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                rows.append(dict(kernel=label, variant=name, us=ms * 1e3, floor_us=flops / PEAK_FLOPS * 1e6,
                                 rate=f"{flops / ms / 1e9:.0f} TFLOP/s", err=err,
                                 default=not extra and tiles == default_tiles))
                _emit(rows, output_json)
            del q, kc, vc, ref
            torch.cuda.empty_cache()
    finally:
        pa._long_prefill_setting, pa.tile_config = setting, tile_config

    seq_lens = [PROMPT] * NUM_SEQS
    q, kc, vc, qsl, sl, bt = _paged_batch([1] * NUM_SEQS, seq_lens, HQ, HKV, D, BS, torch.bfloat16, "cuda", gen)
    order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, scale).float()
    default_splits = pa.choose_num_kv_splits(NUM_SEQS, HKV, 1, MAX_MODEL_LEN, q.device)
    floor_us = decode_bytes(NUM_SEQS, PROMPT) / HBM_BYTES_PER_S * 1e6
    variants = dict(list(DECODE_VARIANTS.items())[:3]) if quick else DECODE_VARIANTS
    try:
        for name, (splits, tiles) in variants.items():
            pa.tile_config = lambda *a, _t=tiles: {**tile_config(*a), **_t}
            n = default_splits if splits is None else splits
            fn = lambda: pa.paged_attention(q, kc, vc, qsl, sl, bt, scale, 1, MAX_MODEL_LEN,  # noqa: E731
                                            num_kv_splits=n, num_decodes=NUM_SEQS, seq_order=order)
            try:
                err = (fn().float() - ref).abs().max().item()
                ms = _time_ms(fn, graph=True)
            except Exception as exc:
                print(f"  decode {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            rows.append(dict(kernel="decode 16 x 16,384 keys, 1 layer", variant=f"{name} ({n} splits)",
                             us=ms * 1e3, floor_us=floor_us, err=err, default=splits is None,
                             rate=f"{decode_bytes(NUM_SEQS, PROMPT) / ms / 1e9:.2f} TB/s"))
            _emit(rows, output_json)
    finally:
        pa.tile_config = tile_config
    return rows


def _emit(rows: list[dict], output_json: str | None) -> None:
    print(_fmt(rows[-1]), flush=True)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(rows, f, indent=1)


def _fmt(r: dict) -> str:
    mark = "*" if r["default"] else " "
    return (f"{r['kernel']:36s} {mark}{r['variant']:26s} {r['us']:9.1f} {r['floor_us']:9.1f} "
            f"{100 * r['floor_us'] / r['us']:6.1f}% {r['rate']:>14s}  err {r['err']:.2e}")


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summary(out: str) -> None:
    """The kernel rows (from long-kernels.json) and the end-to-end runs (long-e2e*.json), one table."""
    rows = _read(os.path.join(out, "long-kernels.json")) or []
    print(f"\n{'long context (issue 49 item 3), H200':36s} {'variant (* default)':27s} {'us':>9s} {'floor us':>9s} "
          f"{'%floor':>7s} {'rate':>14s}")
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        best = min(mine, key=lambda r: r["us"])
        for r in mine:
            if r["default"] or r is best or r["variant"].startswith("short"):
                print(_fmt(r) + ("  <- fastest" if r is best else ""))
    decode = [r for r in rows if r["kernel"].startswith("decode")]
    default = next((r for r in decode if r["default"]), None)
    saved_s = (default["us"] - min(r["us"] for r in decode)) * 1e-6 * LAYERS * OUT_LEN if default else 0.0
    prefill_s, kv_s = e2e_floor_s()
    floor = prefill_s + kv_s
    print(f"\nend to end: 16 x 16,384 in / 256 out, Qwen3-0.6B dummy; floor {floor:.2f} s "
          f"(prefill attention at 50% of peak {prefill_s:.2f} s + decode KV reads at 4.3 TB/s {kv_s:.2f} s)")
    print(f"{'run':52s} {'elapsed s':>10s} {'%floor':>7s} {'target':>8s} met")
    for name, label in (("long-e2e", "default (long-prefill tiles)"),
                        ("long-e2e-short", "LOOM_LONG_PREFILL_TILES=off (before)"),
                        ("long-e2e-mnbt16k", "default, --max-num-batched-tokens 16384")):
        r = _read(os.path.join(out, f"{name}.json"))
        if r is None:
            print(f"{label:52s} {'failed':>10s} (see {out}/{name}.log)")
            continue
        s = r["elapsed_s"]
        print(f"{label:52s} {s:10.2f} {100 * floor / s:6.1f}% {'<= 3.7':>8s} {'yes' if s <= E2E_TARGET_S else 'NO'}")
        if name == "long-e2e" and saved_s > 0:   # what the fastest decode variant would take off, per layer and step
            p = s - saved_s
            print(f"{'  ... with the fastest decode variant (projected)':52s} {p:10.2f} {100 * floor / p:6.1f}% "
                  f"{'<= 3.7':>8s} {'yes' if p <= E2E_TARGET_S else 'NO'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-json", default=None, help="write the kernel rows to this JSON file")
    p.add_argument("--quick", action="store_true", help="three variants of each kernel")
    p.add_argument("--summary", metavar="DIR", default=None,
                   help="print the table from DIR/long-kernels.json and DIR/long-e2e*.json (no GPU)")
    args = p.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return
    t0 = time.perf_counter()
    print(f"{'kernel':36s} {'variant (* default)':27s} {'us':>9s} {'floor us':>9s} {'%floor':>7s} {'rate':>14s}")
    kernel_rows(args.quick, args.output_json)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
