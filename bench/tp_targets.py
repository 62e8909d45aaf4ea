"""Issue 12's tensor-parallel targets in one run (nvidia-h200-x2, bf16, dummy weights):

    python -m bench.tp_targets [--only NAME ...]

Each engine is started once and measured for what its row of the table needs, so the whole
run fits one device call: batch-1 time per output token (as `loom bench latency`: TPOT =
(E2E - TTFT) / (output_len - 1), medians, 128 in / 128 out) and offline output tok/s on the
standard workload (as `loom bench throughput`: 256 requests, one warm-up call first).
A table of measured values against the targets is printed last.

--profile-dir DIR also traces 32 batch-1 decode tokens of each TPOT row with the torch profiler
and prints rank 0's GPU time per token by kernel (CUDA-graph replays included), so the gap to
the weights floor can be read off by kernel: GEMMs, all-reduces, attention, norms.

--one-rank runs each TP=2 row on one GPU as one rank alone: a TP=1 model with one rank's shapes
(half the query and KV heads, half the intermediate size, half the padded vocabulary), so the
rank's GEMMs, attention and sampling are timed without its collectives. The table then adds
2 x layers + 2 collectives per token (two per layer, the embedding's, the logits' gather) at
--collective-us each to the TPOT rows: an estimate for when no 2-GPU machine is lent, not a
measurement. The offline rows alone are an upper bound (collectives free).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import positive_int
from bench.presets import write_preset
from bench.workloads import fixed_workload, make_workload

# name: (preset, tp, measure TPOT, measure offline throughput)
RUNS = {
    "llama8b-tp2": ("llama-3.1-8b", 2, True, False),
    "llama70b-tp2": ("llama-3.1-70b", 2, True, True),
    "qwen3-8b-tp1": ("qwen3-8b", 1, False, True),
    "qwen3-8b-tp2": ("qwen3-8b", 2, False, True),
}


def _tpot(llm, vocab: int, iters: int = 3, n_in: int = 128, n_out: int = 128) -> float:
    from frontend import SamplingParams
    prompts = fixed_workload(2 * iters + 2, n_in, 1, seed=1000, vocab_size=vocab).prompts

    def timed(prompt, max_tokens):
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0

    timed(prompts[-2], 1)
    timed(prompts[-1], n_out)
    ttft = statistics.median(timed(prompts[2 * i], 1) for i in range(iters))
    e2e = statistics.median(timed(prompts[2 * i + 1], n_out) for i in range(iters))
    return 1000 * (e2e - ttft) / (n_out - 1)


def _throughput(llm, vocab: int) -> tuple[float, int]:
    from frontend import SamplingParams
    wl = make_workload(None, None, None, 0, vocab)
    llm.generate([[(7 * i + 3) % vocab for i in range(16)]],
                 SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in wl.max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / elapsed, tokens


def _profile_decode(llm, vocab: int, profile_dir: str, name: str, n_out: int = 32) -> None:
    """Trace n_out batch-1 tokens (after a 128-token prompt) and print GPU time per token by kernel."""
    from bench.kernel_trace import kernel_table, newest_trace
    from frontend import SamplingParams
    prompt = fixed_workload(1, 128, 1, seed=2000, vocab_size=vocab).prompts[0]
    params = SamplingParams(temperature=0.6, max_tokens=n_out, ignore_eos=True)
    llm.start_profile(name)
    llm.generate([prompt], params, use_tqdm=False)
    llm.stop_profile()
    trace = newest_trace(profile_dir, name)
    if trace is None:
        print(f"{name}: no trace in {profile_dir}")
        return
    print(f"--- {name} (prefill included):")
    print("\n".join(kernel_table(trace, per=n_out, unit="token")))


def rank_config(cfg: dict, tp: int) -> dict:
    """A decoder config whose TP=1 model has the shapes of one rank of `tp` (KV heads replicated
    when fewer than the ranks, the vocabulary padded so that it splits, as the sharded model does)."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {**cfg, "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "num_attention_heads": heads // tp, "num_key_value_heads": max(1, kv_heads // tp),
            "intermediate_size": cfg["intermediate_size"] // tp, "vocab_size": -(-cfg["vocab_size"] // tp)}


def _write_rank_model(mdir: str, cfg: dict) -> None:
    """The rank's config, with its special token ids inside its (halved) vocabulary."""
    special = {k: cfg["vocab_size"] - 1 for k in ("bos_token_id", "eos_token_id")}
    for name, content in (("config.json", {**cfg, **special}), ("generation_config.json", special)):
        with open(f"{mdir}/{name}", "w") as f:
            json.dump(content, f)


def measure(name: str, profile_dir: str | None = None, offline: bool = True, one_rank: bool = False,
            engine_args: dict | None = None) -> dict:
    import tempfile
    from frontend import LLM
    preset, tp, want_tpot, want_tput = RUNS[name]
    want_tput = want_tput and offline
    with tempfile.TemporaryDirectory(prefix=f"loom-tp-{preset}-") as mdir:
        write_preset(preset, mdir)
        with open(f"{mdir}/config.json") as f:
            cfg = json.load(f)
        one_rank = one_rank and tp > 1
        if one_rank:
            cfg, tp = rank_config(cfg, tp), 1
            _write_rank_model(mdir, cfg)
        vocab, layers = cfg["vocab_size"], cfg["num_hidden_layers"]
        t0 = time.perf_counter()
        extra = {"profiler_dir": profile_dir} if profile_dir and want_tpot else {}
        llm = LLM(mdir, load_format="dummy", tensor_parallel_size=tp, max_model_len=4096, seed=0, **extra,
                  **(engine_args or {}))
        res = {"name": name, "preset": preset, "tp": tp, "one_rank": one_rank,
               "layers": layers, "startup_s": time.perf_counter() - t0, "kv_blocks": llm.num_gpu_blocks}
        try:
            res["all_reduce"] = llm.collective_rpc("all_reduce_info")[0]
            if want_tpot:
                res["tpot_ms"] = _tpot(llm, vocab)
                if extra:
                    _profile_decode(llm, vocab, profile_dir, name)
            if want_tput:
                res["output_tok_per_s"], res["output_tokens"] = _throughput(llm, vocab)
        finally:
            llm.shutdown()
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=sorted(RUNS), default=list(RUNS), help="run these rows (default: all)")
    p.add_argument("--output-json", default=None, help="write every row's measurements here")
    p.add_argument("--profile-dir", default=None, help="trace batch-1 decode of the TPOT rows here")
    p.add_argument("--no-offline", action="store_true", help="skip the offline-throughput rows (TPOT only)")
    p.add_argument("--one-rank", action="store_true",
                   help="time each TP=2 row as one rank alone on one GPU (no collectives); see above")
    p.add_argument("--collective-us", type=float, default=7.0,
                   help="with --one-rank: us per decode collective added to the TPOT estimate (default 7.0: "
                        "the fused all-reduce + add + RMSNorm at one row on 2xH200, bench/RESULTS.md session 5)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="each engine's token budget per step (default: loom serve's)")
    args = p.parse_args()
    engine_args = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    results = {}
    for name in args.only:
        try:
            results[name] = measure(name, args.profile_dir, offline=not args.no_offline, one_rank=args.one_rank,
                                    engine_args=engine_args)
        except Exception as e:  # one failed configuration must not hide the others' numbers
            print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
            results[name] = {"name": name, "error": str(e)}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    _table(results, args.collective_us if args.one_rank else None)
    return 0


def _table(r: dict, collective_us: float | None = None) -> None:
    def get(name, key):
        v = r.get(name, {}).get(key)
        if v is not None and key == "tpot_ms" and collective_us is not None and r[name]["one_rank"]:
            v += (2 * r[name]["layers"] + 2) * collective_us / 1000
        return v

    if collective_us is not None:
        print(f"\nONE RANK ALONE on one GPU: TPOT rows add {collective_us} us per collective "
              f"(an estimate); offline TP=2 rows leave the collectives out (an upper bound)")
    rows = []
    v = get("llama8b-tp2", "tpot_ms")
    rows.append(("Llama-3.1-8B TP=2 batch-1 TPOT", v, "ms", "<= 2.6", v is not None and v <= 2.6))
    v = get("llama70b-tp2", "tpot_ms")
    rows.append(("Llama-3.1-70B TP=2 batch-1 TPOT", v, "ms", "<= 20", v is not None and v <= 20))
    v = get("llama70b-tp2", "output_tok_per_s")
    rows.append(("Llama-3.1-70B TP=2 offline", v, "tok/s", ">= 3000", v is not None and v >= 3000))
    a, b = get("qwen3-8b-tp1", "output_tok_per_s"), get("qwen3-8b-tp2", "output_tok_per_s")
    rows.append(("Qwen3-8B offline TP=1", a, "tok/s", "-", None))
    rows.append(("Qwen3-8B offline TP=2", b, "tok/s", "-", None))
    ratio = b / a if a and b else None
    rows.append(("Qwen3-8B offline TP=2 / TP=1", ratio, "x", ">= 1.6", ratio is not None and ratio >= 1.6))
    print()
    print(f"{'workload':<34} {'measured':>10} {'unit':<6} {'target':<8} ok")
    for label, val, unit, target, ok in rows:
        shown = "-" if val is None else f"{val:.2f}"
        print(f"{label:<34} {shown:>10} {unit:<6} {target:<8} {'' if ok is None else ('yes' if ok else 'NO')}")
    one_shot = [x.get("all_reduce", {}).get("one_shot") for x in r.values() if x.get("tp") == 2]
    print(f"one-shot (symmetric memory) all-reduce in use at TP=2: {one_shot}")


if __name__ == "__main__":
    raise SystemExit(main())
