"""Multi-LoRA serving on the GPU (issue 51's targets; `bench/gpu_suite.sh lora`).

Llama-3.1-8B shapes with random (dummy) weights, bf16, and 8 random rank-16 adapters on all
seven projections (q/k/v/o, gate/up/down), written in PEFT's format. In one process:

  1. an engine with --enable-lora --max-loras 8 --max-lora-rank 16 per kernel variant (--variants;
     VARIANTS: the env vars of each):
     - the standard offline workload with base requests only, then spread over the 8 adapters
       (request i runs adapter i % 8): throughput ratio, target >= 0.90;
     - batch-1 time per output token with an adapter and without: ratio, target <= 1.08;
     - LLM.add_lora of a 9th adapter while 64 long streams run: ms until it is loaded (target
       <= 50 ms; the inter-token gaps are not measured offline);
  2. an engine without --enable-lora (after the first variant): the same base workload and the
     batch-1 TPOT; the LoRA engine's base-only run over it, target >= 0.98.

The table (rows x variants) is printed after each engine, the last one complete.

    python -m bench.lora [--num-prompts N] [--output-json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

TARGETS = {"adapters_vs_base": 0.90, "lora_engine_base_vs_plain": 0.98, "tpot_ratio": 1.08, "load_ms": 50.0}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(out_dir: str, cfg: dict, rank: int, seed: int) -> str:
    """A rank-`rank` PEFT adapter of every projection of every layer, random bf16 weights."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for i in range(layers):
        for name, (n_in, n_out) in shapes.items():
            module = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{module}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * 0.01).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.01).bfloat16()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
                   "bias": "none", "use_rslora": False}, f)
    return out_dir


def _run(llm, wl, loras) -> float:
    from frontend import SamplingParams
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in wl.max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def _tpot_ms(llm, prompts, lora, n_out: int = 256) -> float:
    """Median over the prompts of (E2E - TTFT) / (n_out - 1) at batch 1."""
    from frontend import SamplingParams
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False,
                     lora_request=lora)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True), use_tqdm=False,
                     lora_request=lora)
        out.append((time.perf_counter() - t0 - ttft) / (n_out - 1) * 1e3)
    return statistics.median(out)


def _load_while_streaming(llm, path: str) -> float:
    """ms of LLM.add_lora (a new adapter read, checked and cached on every worker) while 64
    streams decode: they are enqueued first, the engine steps them in its own process."""
    from frontend import SamplingParams
    llm.enqueue([[7 + i, 11, 13] * 40 for i in range(64)],
                SamplingParams(temperature=0, max_tokens=min(512, llm.config.max_model_len - 130), ignore_eos=True))
    time.sleep(1.0)   # decoding by now
    t0 = time.perf_counter()
    llm.add_lora("late", 99, path, False)
    ms = (time.perf_counter() - t0) * 1e3
    llm.wait_for_completion(use_tqdm=False)
    return ms


# the kernel variants (env vars, read by the workers at start): "new" as shipped; "rowwise": new with
# one program per row at 16-256 rows (LOOM_LORA_SORTED_ROWS=0: the default before session 36); "old" is
# session 31's (every decode step replays the LoRA graphs; one program per row at 16-256 rows; at batch 1
# the shrink and the expand in their own kernels); "sep": new but the expand in its own kernel after the
# GEMV (not in its epilogue); "k1": new with the batch-1 shrink split into one K block per program (more
# programs, more partials); "nofuse": new with the batch-1 shrink in its own kernel, after the norm's or
# SiLU's (LOOM_LORA_FUSED_SHRINK=0)
VARIANTS = {"new": {}, "rowwise": {"LOOM_LORA_SORTED_ROWS": "0"},
            "old": {"LOOM_LORA_BASE_GRAPHS": "0", "LOOM_LORA_SORTED_ROWS": "0", "LOOM_LORA_PDL": "0",
                    "LOOM_LORA_FUSED_EXPAND": "0", "LOOM_LORA_FUSED_SHRINK": "0"},
            "sep": {"LOOM_LORA_FUSED_EXPAND": "0"}, "k1": {"LOOM_LORA_SHRINK_K_BLOCKS": "1"},
            "nofuse": {"LOOM_LORA_FUSED_SHRINK": "0"}}
TPOT_ONLY = {"sep", "k1", "nofuse"}   # (they change batches below 16 rows only: their throughput rows would repeat new's)


def _rows(res: dict, r: dict) -> list[tuple[str, float | None, str, float]]:
    def ratio(a, b):
        return a / b if a is not None and b else None
    return [("8 adapters / base, same engine (tok/s)", ratio(r.get("adapters_tok_s"), r.get("base_tok_s")), ">=",
             TARGETS["adapters_vs_base"]),
            ("base on LoRA engine / engine without LoRA", ratio(r.get("base_tok_s"), res.get("plain_engine_tok_s")),
             ">=", TARGETS["lora_engine_base_vs_plain"]),
            ("batch-1 TPOT adapter / base (same engine)", ratio(r.get("tpot_lora_ms"), r.get("tpot_base_ms")), "<=",
             TARGETS["tpot_ratio"]),
            ("batch-1 TPOT adapter / engine without LoRA", ratio(r.get("tpot_lora_ms"), res.get("plain_tpot_ms")),
             "<=", TARGETS["tpot_ratio"]),
            ("batch-1 TPOT base on LoRA engine (ms)", r.get("tpot_base_ms"), "<=", res.get("plain_tpot_ms") or 0.0),
            ("add_lora while 64 streams run (ms)", r.get("load_ms"), "<=", TARGETS["load_ms"])]


def _table(res: dict, variants: list[str]) -> None:
    """The rows per variant, side by side (the target judged on the first variant's)."""
    cols = {v: _rows(res, res["variants"].get(v, {})) for v in variants}
    print(f"\n{'LoRA, Llama-3.1-8B shapes, rank-16 on 7 projections (issue 51)':52s}"
          + "".join(f" {v:>9s}" for v in variants) + f" {'target':>9s}", flush=True)
    for i, (name, _, op, want) in enumerate(cols[variants[0]]):
        vals = [cols[v][i][1] for v in variants]
        got = vals[0]
        verdict = "" if got is None else ("ok" if (got >= want if op == ">=" else got <= want) else "MISS")
        print(f"{name:52s}" + "".join(f" {v:9.3f}" if v is not None else f" {'-':>9s}" for v in vals)
              + f" {op + format(want, '.4g'):>9s} {verdict}", flush=True)
    res["rows"] = {v: [{"name": n, "measured": g, "target": f"{op}{w}"} for n, g, op, w in cols[v]]
                   for v in variants}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=None, help="requests of the offline workload (None: 256)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--output-json", default=None)
    p.add_argument("--model", default=None, help="a model directory instead of the Llama-3.1-8B preset (smoke tests)")
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length instead of the standard workload")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--tpot-len", type=int, default=256, help="output tokens of the batch-1 TPOT runs")
    p.add_argument("--variants", default="new,rowwise", help=f"LoRA engines to time, in order ({', '.join(VARIANTS)})")
    args = p.parse_args(argv)

    from bench.presets import PRESETS, write_preset
    from bench.workloads import make_workload, fixed_workload
    from frontend import LLM, LoRARequest

    tmp = tempfile.mkdtemp(prefix="loom-bench-lora-")
    if args.model:
        mdir = args.model
        with open(os.path.join(mdir, "config.json")) as f:
            cfg = json.load(f)
    else:
        cfg = PRESETS["llama-3.1-8b"]
        mdir = write_preset("llama-3.1-8b", os.path.join(tmp, "model"))
    t0 = time.perf_counter()
    paths = [write_random_adapter(os.path.join(tmp, f"lora{i}"), cfg, args.rank, seed=i)
             for i in range(args.num_adapters + 1)]
    print(f"{len(paths)} rank-{args.rank} adapters written in {time.perf_counter() - t0:.1f} s", flush=True)
    wl = make_workload(args.num_prompts, args.input_len, args.output_len, 0, cfg["vocab_size"])
    loras = [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(paths[:-1])]
    per_request = [loras[i % len(loras)] for i in range(len(wl.prompts))]
    short = fixed_workload(3, 32, 1, seed=7, vocab_size=cfg["vocab_size"]).prompts
    opts = dict(load_format="dummy", max_model_len=min(4096, cfg.get("max_position_embeddings") or 4096), seed=0)
    res: dict = {"variants": {}}
    variants = [v for v in args.variants.split(",") if v]

    def engine(variant: str):
        """The LoRA engine of a kernel variant (its env vars are read by the workers at start)."""
        saved = {k: os.environ.get(k) for k in VARIANTS[variant]}
        os.environ.update(VARIANTS[variant])
        try:
            return LLM(mdir, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
                       max_cpu_loras=args.num_adapters + 2, **opts)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    for i, variant in enumerate(variants):
        r = res["variants"][variant] = {}
        with engine(variant) as llm:
            llm.generate(short, use_tqdm=False, lora_request=loras[:3])   # warm-up: adapters read, slots filled
            if variant not in TPOT_ONLY:
                r["base_tok_s"] = _run(llm, wl, None)
                r["adapters_tok_s"] = _run(llm, wl, per_request)
                print(f"[{variant}] base {r['base_tok_s']:.0f} tok/s, {len(loras)} adapters "
                      f"{r['adapters_tok_s']:.0f} tok/s", flush=True)
            r["tpot_base_ms"] = _tpot_ms(llm, short, None, args.tpot_len)
            r["tpot_lora_ms"] = _tpot_ms(llm, short, loras[0], args.tpot_len)
            print(f"[{variant}] batch-1 TPOT base {r['tpot_base_ms']:.3f} ms, adapter {r['tpot_lora_ms']:.3f} ms",
                  flush=True)
            if i == 0:
                r["load_ms"] = _load_while_streaming(llm, paths[-1])
                print(f"[{variant}] add_lora while 64 streams run: {r['load_ms']:.1f} ms", flush=True)
        _table(res, variants)
        if i == 0:   # the engine without LoRA, after the first variant (a cut run still has the ratios)
            with LLM(mdir, **opts) as llm:
                llm.generate(short, use_tqdm=False)
                res["plain_engine_tok_s"] = _run(llm, wl, None)
                res["plain_tpot_ms"] = _tpot_ms(llm, short, None, args.tpot_len)
                print(f"engine without LoRA: {res['plain_engine_tok_s']:.0f} output tok/s, batch-1 TPOT "
                      f"{res['plain_tpot_ms']:.3f} ms", flush=True)
            _table(res, variants)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
