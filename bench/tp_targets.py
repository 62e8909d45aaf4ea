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
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

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


def measure(name: str, profile_dir: str | None = None, offline: bool = True) -> dict:
    import tempfile
    from frontend import LLM
    preset, tp, want_tpot, want_tput = RUNS[name]
    want_tput = want_tput and offline
    with tempfile.TemporaryDirectory(prefix=f"loom-tp-{preset}-") as mdir:
        write_preset(preset, mdir)
        with open(f"{mdir}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
        t0 = time.perf_counter()
        extra = {"profiler_dir": profile_dir} if profile_dir and want_tpot else {}
        llm = LLM(mdir, load_format="dummy", tensor_parallel_size=tp, max_model_len=4096, seed=0, **extra)
        res = {"name": name, "preset": preset, "tp": tp, "startup_s": time.perf_counter() - t0,
               "kv_blocks": llm.num_gpu_blocks}
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
    p.add_argument("--only", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    p.add_argument("--output-json", default=None)
    p.add_argument("--profile-dir", default=None, help="trace batch-1 decode of the TPOT rows here")
    p.add_argument("--no-offline", action="store_true", help="skip the offline-throughput rows (TPOT only)")
    args = p.parse_args()
    results = {}
    for name in args.only:
        try:
            results[name] = measure(name, args.profile_dir, offline=not args.no_offline)
        except Exception as e:  # one failed configuration must not hide the others' numbers
            print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
            results[name] = {"name": name, "error": str(e)}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    _table(results)
    return 0


def _table(r: dict) -> None:
    def get(name, key):
        return r.get(name, {}).get(key)

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
