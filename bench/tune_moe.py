"""Tune kernels/fused_moe.py's tile configs on the GPU and write them where the kernel loads
them (vLLM's benchmark_moe.py --tune, for our kernel):

    export PYTHONPATH=$PWD; python3 -m bench.tune_moe --model-shape qwen3-30b-a3b [--batch-sizes 1 8 ...]

For each token count it times a pruned space of tile configs (~20-40: 16-row blocks and narrow
tiles where a few tokens reach each expert, 64/128-row blocks and wide tiles where many do;
tiles whose pipeline stages overflow shared memory are skipped), checks the fastest against
the default config's output, and writes kernels/fused_moe_configs/E=..,N=..,device_name=..,
dtype=bf16.json: token count -> config, keyed by this GPU's name (the kernel then picks the
nearest token count). Triton compiles each config's two kernels once; --compile-workers
processes compile them all first, in parallel, into Triton's disk cache, so the sweep itself
loads them (one model shape: a few minutes on an H200).

Each time is one call's share of a CUDA graph that runs the MoE once per routing, over
`reps` different random routings (softmax top-k of random logits), so that a small batch
reads other experts each call rather than the last call's from L2.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import time
from dataclasses import dataclass

import torch

from kernels import fused_moe as fm

HBM_BYTES_PER_S = 4.3e12  # device-to-device copy rate measured on the H200 (docs/performance.md)
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
SMEM_BYTES = 200 * 1024   # per-SM shared memory a config's pipeline stages may use (H100/H200: 227 KB)


@dataclass(frozen=True)
class MoeShape:
    """One model's MoE layer (HF config values): experts, hidden, expert intermediate, top-k."""
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    activation: str = "silu"
    bias: bool = False


MODEL_SHAPES = {
    "qwen3-30b-a3b": MoeShape(128, 2048, 768, 8),
    "mixtral-8x7b": MoeShape(8, 4096, 14336, 2),
    "qwen2-57b-a14b": MoeShape(64, 3584, 2560, 8),          # its shared expert is a dense MLP
    "gpt-oss-20b": MoeShape(32, 2880, 2880, 4, activation="swigluoai", bias=True),
}


def search_space(num_tokens: int, shape: MoeShape) -> list[fm.MoeTileConfig]:
    """The configs worth timing at num_tokens, by the mean tokens per expert."""
    per_expert = num_tokens * shape.top_k / shape.num_experts
    cands = []
    if per_expert <= 16:     # weight-bandwidth bound: 16-row blocks, many narrow programs
        cands += [(16, bn, bk, 1, 4, s) for bn in (32, 64, 128) for bk in (64, 128, 256) for s in (3, 4)]
        cands += [(16, bn, bk, 1, 4, 5) for bn, bk in ((32, 128), (64, 64), (128, 64))]
        cands += [(16, 256, 128, 1, 8, 3), (16, 128, 128, 1, 8, 4), (32, 64, 128, 1, 4, 3), (32, 128, 128, 1, 4, 3)]
    if 4 < per_expert <= 128:
        cands += [(bm, bn, bk, g, 4, 3) for bm in (32, 64) for bn in (64, 128) for bk in (64, 128) for g in (1, 16)]
        cands += [(bm, 256, 64, 1, 8, 3) for bm in (32, 64)]
    if per_expert > 64:      # compute bound: wide tiles, grouped ordering for L2 reuse of B
        cands += [(bm, bn, 64, g, 4 if bn == 128 else 8, s) for bm in (64, 128) for bn in (128, 256)
                  for g in (1, 16) for s in (3, 4)]
        # 8-warp 128-row tiles (Hopper's wgmma wants 128 x 128+ per 2 warpgroups), deeper pipelines
        cands += [(128, bn, 64, g, 8, s) for bn in (128, 256) for g in (8, 16) for s in (3, 4)]
        cands += [(64, 64, 64, 8, 4, 3), (64, 64, 128, 8, 4, 3)]
    out = []
    for c in dict.fromkeys(cands):
        cfg = fm.MoeTileConfig(*c)
        smem = (cfg.BLOCK_SIZE_M + cfg.BLOCK_SIZE_N) * cfg.BLOCK_SIZE_K * 2 * cfg.num_stages
        if smem <= SMEM_BYTES:
            out.append(cfg)
    default = fm.default_config(num_tokens, shape.num_experts, shape.top_k)
    return out if default in out else [default] + out


class MoeCase:
    """One layer's weights and `reps` routings of num_tokens tokens, bf16 on the GPU."""

    def __init__(self, shape: MoeShape, intermediate: int, num_tokens: int, reps: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        e, h, i, k = shape.num_experts, shape.hidden, intermediate, shape.top_k
        bf = dict(device="cuda", dtype=torch.bfloat16)
        self.w13 = torch.randn(e, 2 * i, h, generator=g, **bf) * h ** -0.5
        self.w2 = torch.randn(e, h, i, generator=g, **bf) * i ** -0.5
        self.b13 = torch.randn(e, 2 * i, generator=g, **bf) * 0.1 if shape.bias else None
        self.b2 = torch.randn(e, h, generator=g, **bf) * 0.1 if shape.bias else None
        self.hidden = torch.randn(num_tokens, h, generator=g, **bf)
        self.routings = [fm.select_experts(torch.randn(num_tokens, e, generator=g, device="cuda"), k, True)
                         for _ in range(reps)]
        self.activation, self.num_tokens = shape.activation, num_tokens
        expert_bytes = 3 * h * i * 2
        distinct = sum(len(torch.unique(ids)) for _, ids in self.routings) / reps
        self.weight_bytes = distinct * expert_bytes     # the experts one call must read
        self.flops = 2 * num_tokens * k * 3 * h * i

    def run(self, cfg: fm.MoeTileConfig | None, rep: int = 0, gemv: fm.MoeGemvConfig | None = None) -> torch.Tensor:
        """cfg: the grouped GEMMs with these tiles; gemv: the GEMV path with these; neither: the
        kernel's own choice for the token count."""
        w, ids = self.routings[rep]
        return fm.fused_moe(self.hidden, self.w13, self.w2, w, ids, w13_bias=self.b13, w2_bias=self.b2,
                            activation=self.activation, config=cfg, gemv=gemv)

    def per_call_us(self, cfg: fm.MoeTileConfig | None, iters: int = 5, gemv: fm.MoeGemvConfig | None = None,
                    ) -> float:
        """One call's share of a graph running every routing once, over `iters` replays."""
        reps = len(self.routings)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for r in range(reps):    # compile and warm up outside the capture
                self.run(cfg, r, gemv)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(reps):
                self.run(cfg, r, gemv)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters / reps


def _compile(job: tuple[MoeShape, int, list[fm.MoeTileConfig]]) -> int:
    """In a worker process: run every config once on uninitialised weights of the real shape
    (the kernels specialise on the shape, not the values), at one token (the one-program
    alignment) and at 64 (the chunked one), which leaves their binaries in Triton's cache."""
    shape, intermediate, configs = job
    e, h, k = shape.num_experts, shape.hidden, shape.top_k
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w13, w2 = torch.empty(e, 2 * intermediate, h, **bf), torch.empty(e, h, intermediate, **bf)
    b13 = torch.empty(e, 2 * intermediate, **bf) if shape.bias else None
    b2 = torch.empty(e, h, **bf) if shape.bias else None
    for m in (1, 64):
        w, ids = fm.select_experts(torch.randn(m, e, device="cuda"), k, True)
        for cfg in configs:
            try:
                fm.fused_moe(torch.randn(m, h, **bf), w13, w2, w, ids, w13_bias=b13, w2_bias=b2,
                             activation=shape.activation, config=cfg)
            except Exception:  # noqa: BLE001 (the sweep reports a config that does not build)
                pass
    torch.cuda.synchronize()
    return len(configs)


def precompile(shape: MoeShape, intermediate: int, configs: list[fm.MoeTileConfig], workers: int) -> None:
    """Compile the configs' kernels in `workers` processes at once (Triton compiles one kernel at
    a time per process, ~1-2 s each: ~100 of them per model shape)."""
    if workers <= 0 or not configs:
        return
    jobs = [(shape, intermediate, configs[i::workers]) for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            list(pool.map(_compile, [j for j in jobs if j[2]]))
    except Exception as e:  # noqa: BLE001 (the sweep then compiles as it goes)
        print(f"precompile failed ({type(e).__name__}: {e}); compiling during the sweep", flush=True)


def reps_for(num_tokens: int) -> int:
    """Routings per graph: enough calls to hide launch gaps at a few tokens, few at many."""
    return 16 if num_tokens <= 64 else 4 if num_tokens <= 1024 else 2


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def tune(shape: MoeShape, intermediate: int, batch_sizes: list[int], verbose: bool = True,
         ) -> dict[int, tuple[fm.MoeTileConfig, float, float]]:
    """num_tokens -> (fastest config, its us, the default config's us)."""
    out = {}
    for m in batch_sizes:
        case = MoeCase(shape, intermediate, m, reps_for(m), seed=m)
        default = fm.default_config(m, shape.num_experts, shape.top_k)
        want = case.run(default)
        times = {}
        for cfg in search_space(m, shape):
            try:
                times[cfg] = case.per_call_us(cfg)
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit is skipped)
                if verbose:
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        best = min(times, key=times.get)
        err = rel_error(case.run(best), want)
        if err > 2e-2:
            raise RuntimeError(f"{m} tokens: {best} differs from the default config's output by {err:.3g}")
        out[m] = (best, times[best], times[default])
        if verbose:
            print(f"{m:6d} tokens: {times[best]:9.1f} us ({len(times)} configs; default {times[default]:.1f} us, "
                  f"{times[default] / times[best]:.2f}x) {best.to_json()}", flush=True)
        del case
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", required=True, choices=list(MODEL_SHAPES))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=BATCH_SIZES, help="token counts to tune")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (each rank's intermediate slice)")
    ap.add_argument("--out-dir", default=str(fm.CONFIG_DIR), help="where to write the JSON file")
    ap.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes compiling the configs before the sweep (0: compile as it goes)")
    args = ap.parse_args()
    shape = MODEL_SHAPES[args.model_shape]
    intermediate = shape.intermediate // args.tp
    device = fm.device_name(torch.device("cuda"))
    name = fm.config_file_name(shape.num_experts, intermediate, torch.bfloat16, device)
    print(f"tuning {args.model_shape} (E={shape.num_experts}, H={shape.hidden}, I={intermediate}, "
          f"top-{shape.top_k}, {shape.activation}) on {device}", flush=True)
    t0 = time.perf_counter()
    sizes = sorted(set(args.batch_sizes))
    configs = list(dict.fromkeys(c for m in sizes for c in search_space(m, shape)))
    precompile(shape, intermediate, configs, args.compile_workers)
    print(f"{len(configs)} configs compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    results = tune(shape, intermediate, sizes)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, name)
    with open(path, "w") as f:
        json.dump({str(m): cfg.to_json() for m, (cfg, _, _) in results.items()}, f, indent=4)
        f.write("\n")
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
