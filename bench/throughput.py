"""`loom bench throughput`: the offline workload through `LLM.generate`.

By default the nano-vllm / mini-sglang workload of docs/performance.md: 256
random token-id prompts of 100-1024 tokens, max_tokens 100-1024, temperature
0.6, ignore_eos, max_model_len 4096, one warm-up call first. Throughput is
output tokens over the wall time of the whole generate() call (prefill
included). --input-len/--output-len switch to fixed lengths.

--sampling runs the workload once per sampling mode on one engine, plain
temperature first, and prints each mode's throughput as a ratio to plain:
  topp       temperature, top-p 0.9, top-k 50
  penalties  topp + repetition penalty 1.1 + presence penalty 0.5
  topp-only  temperature, top-p 0.95 and no top-k (what OpenAI-style clients send)
  topp-penalties  topp-only + repetition penalty 1.1 + presence penalty 0.5
  logprobs   temperature, logprobs=5 on every request
  n4seed     a quarter of the prompts, n=4 with a seed each; its ratio is to
             the same prompts sent as 4 separate unseeded requests (n4sep)

--shard R/N runs only requests R, R+N, R+2N, ...: about what engine R of a DP=N
run gets, so one GPU times one engine's share (DP=N's time is about the slowest
shard's, the engines being independent).

The HBM floor: the time the plain run's engine steps would take if each only read its bytes
at the H200's copy rate (4.3 TB/s): every step's weights (a MoE model's shared weights and the
expected distinct experts its tokens choose, E·(1 - (1 - k/E)^T) per layer), KV cache and
embedding rows, as metrics/mfu.py counts them; printed beside the run as a fraction of it.

--profiler-dir DIR traces the plain run (and the --structured-output run) with the torch profiler and prints the
GPU time per engine step by kernel, CUDA-graph replays included (the traced
run is slower than an untraced one).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from bench import common
from bench.workloads import OFFLINE_OUTPUT_TOKENS, OFFLINE_PROMPT_TOKENS, make_workload


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (LLM.generate) on the standard workload",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--num-prompts", type=common.positive_int, default=None, help="requests (None: 256)")
    p.add_argument("--input-len", type=common.positive_int, default=None, help="fixed prompt length instead of randint(100, 1024)")
    p.add_argument("--output-len", type=common.positive_int, default=None,
                   help="fixed output length instead of randint(100, 1024)")
    p.add_argument("--shard", type=shard_arg, default=None, metavar="R/N",
                   help="run only requests R, R+N, ...: engine R's share of a DP=N run, on one engine")
    p.add_argument("--seed", type=int, default=0, help="workload seed (also the engine's sampling seed)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up call")
    p.add_argument("--sampling", nargs="+", choices=SAMPLING_MODES, default=["plain"],
                   help="sampling modes to run, each on the same engine after plain temperature, with their "
                        "throughput ratios (default: plain)")
    p.add_argument("--output-json", default=None, help="write the results to this JSON file")
    p.add_argument("--compare-hf", action="store_true",
                   help="then run HF transformers generate on the same model and shape in this process "
                        "(fixed lengths; the random workload uses its mean lengths) and print the ratio")
    p.add_argument("--structured-output", choices=["json"], default=None,
                   help="then run the same workload under a JSON schema (same token counts) in the same engine, "
                        "print both rates, and the step time while new schemas compile (bench/structured.py)")
    p.add_argument("--skip-compile-stall", action="store_true",
                   help="with --structured-output: the rates only, not the compile-stall runs")
    p.add_argument("--progress", action="store_true", help="show a progress bar (off: it costs CPU time)")
    common.add_engine_args(p)
    p.set_defaults(func=main)


def shard_arg(text: str) -> tuple[int, int]:
    try:
        rank, size = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= rank < size:
        raise argparse.ArgumentTypeError(f"R must be in [0, N), got {text!r}")
    return rank, size


SAMPLING_MODES = ("plain", "topp", "penalties", "topp-only", "topp-penalties", "logprobs", "n4seed")


def sampling_runs(mode: str, wl, temperature: float) -> list[tuple[str, list, list]]:
    """(name, prompts, SamplingParams per prompt) of the generate() calls a mode makes."""
    from frontend import SamplingParams

    def params(**kw):
        return [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m, **kw) for m in wl.max_tokens]
    topp = dict(top_p=0.9, top_k=50)
    if mode == "n4seed":  # n=4 seeded vs the same 4 requests sent separately
        q = max(len(wl.prompts) // 4, 1)
        prompts, max_tokens = wl.prompts[:q], wl.max_tokens[:q]
        return [("n4sep", [p for p in prompts for _ in range(4)],
                 [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m)
                  for m in max_tokens for _ in range(4)]),
                ("n4seed", prompts, [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m, n=4,
                                                    seed=i) for i, m in enumerate(max_tokens)])]
    pens = dict(repetition_penalty=1.1, presence_penalty=0.5)
    kw = {"plain": {}, "topp": topp, "penalties": dict(topp, **pens), "topp-only": dict(top_p=0.95),
          "topp-penalties": dict(top_p=0.95, **pens), "logprobs": dict(logprobs=5)}[mode]
    return [(mode, wl.prompts, params(**kw))]


def check_fits(workload, max_model_len: int) -> None:
    longest = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens))
    if longest > max_model_len:
        raise SystemExit(f"a request needs {longest} tokens but --max-model-len is {max_model_len}; "
                         f"raise --max-model-len or shorten the requests")


def sampling_report(runs: dict) -> dict:
    """Output tok/s of each run and its ratio to its baseline (n4seed: n4sep; others: plain)."""
    rate = {name: sum(len(c.token_ids) for o in outs for c in o.outputs) / t for name, (t, outs) in runs.items()}
    out = {}
    for name, r in rate.items():
        base = "n4sep" if name == "n4seed" else "plain"
        out[name] = {"output_tok_per_s": r, "baseline": base, "ratio": r / rate[base]}
        print(f"sampling {name:10s} {r:10.1f} output tok/s  {r / rate[base]:.3f}x of {base}")
    return out


def engine_snapshot(stats) -> tuple[dict, dict, dict]:
    return dict(stats.engine_steps), dict(stats.engine_tokens), dict(stats.engine_last_output_at)


def engine_report(before: tuple, after: tuple, t0: float) -> list[dict]:
    """Per engine, over one generate() call that started at t0 (perf_counter): steps, output tokens,
    and when its last output arrived. Equal steps and end times with DP=2 at well over half of
    DP=1's time per step mean the engines set the pace, not this process."""
    (steps0, tokens0, _), (steps1, tokens1, last1) = before, after
    return [{"engine": e, "steps": steps1[e] - steps0.get(e, 0), "output_tokens": tokens1.get(e, 0) - tokens0.get(e, 0),
             "last_output_s": max(last1.get(e, t0) - t0, 0.0)} for e in sorted(steps1)]


def print_kernel_time(profile_dir: str, steps: int) -> None:
    """--profiler-dir: the traced run's GPU time by kernel, per engine step (rank 0 of engine 0;
    the profiler slows the run, so its tok/s is not the untraced one's)."""
    from bench.kernel_trace import kernel_table, newest_trace
    trace = newest_trace(profile_dir, "throughput")
    print("\n".join(kernel_table(trace, per=max(steps, 1), unit="step") if trace else
                    [f"no trace in {profile_dir}"]))


def main(args: argparse.Namespace) -> int:
    from frontend import LLM

    with common.model_dir(args) as mdir:
        opts = common.engine_options(args, mdir)
        vocab = common.read_model_config(mdir).get("vocab_size")
        wl = load_workload(args, vocab, opts["max_model_len"])
        t0 = time.perf_counter()
        llm = LLM(mdir, **opts)
        startup = time.perf_counter() - t0
        print(f"engine up in {startup:.1f} s ({llm.num_gpu_blocks} KV blocks)", flush=True)
        num_gpu_blocks = llm.num_gpu_blocks
        try:
            runs = timed_runs(llm, wl, args, vocab, opts.get("profiler_dir"))
        finally:
            llm.shutdown()
        result = report(args, wl, runs, opts, startup)
        floor = hbm_floor_s(runs.steps, common.read_model_config(mdir), opts, len(runs.engines))
        result.update(hbm_floor_s=floor, hbm_floor_fraction=floor / result["elapsed_s"])
        print(f"HBM floor: {floor:.2f} s for the {len(runs.steps)} steps' weights, KV and embedding reads at "
              f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s: the run took {result['elapsed_s']:.2f} s "
              f"({100 * result['hbm_floor_fraction']:.0f}% of the floor's speed)")
        result["num_gpu_blocks"] = num_gpu_blocks
        if args.compare_hf:
            result.update(compare_hf(args, wl, mdir, opts, result["output_tok_per_s"]))
        common.write_json(args.output_json, result)
    return 0 if result["totals_ok"] else 1


def load_workload(args: argparse.Namespace, vocab: int | None, max_model_len: int):
    """The requests to time (the standard workload checked against its published totals), printed."""
    wl = make_workload(args.num_prompts, args.input_len, args.output_len, args.seed, vocab)
    if wl.is_default:
        assert (wl.prompt_tokens, wl.output_tokens) == (OFFLINE_PROMPT_TOKENS, OFFLINE_OUTPUT_TOKENS), \
            (wl.prompt_tokens, wl.output_tokens)
    if args.shard:
        wl = wl.shard(*args.shard)
    check_fits(wl, max_model_len)
    shape = ("standard offline workload (random lengths)" if wl.is_default else
             "random lengths" if args.input_len is None and args.output_len is None else
             f"fixed lengths {len(wl.prompts[0])} in / {wl.max_tokens[0]} out")
    if args.shard:
        shape += ", shard {}/{} of it".format(*args.shard)
    print(f"model {common.model_label(args)}: {len(wl)} requests, {shape}, "
          f"{wl.prompt_tokens} prompt tokens, {wl.output_tokens} output tokens", flush=True)
    return wl


HBM_BYTES_PER_S = 4.3e12  # device-to-device copy rate measured on the H200 (docs/performance.md)


def hbm_floor_s(steps: list, model_config: dict, opts: dict, num_engines: int) -> float:
    """Seconds the logged engine steps would take reading only their bytes at HBM_BYTES_PER_S,
    per GPU (the data-parallel engines' steps split evenly over their GPUs)."""
    from types import SimpleNamespace

    from metrics.mfu import MfuEstimator, ModelShape, dtype_bytes
    engine = SimpleNamespace(dtype=opts.get("dtype") or "auto", device=opts.get("device") or "auto")
    est = MfuEstimator(ModelShape.from_hf_config(model_config, dtype_bytes(engine),
                                                 opts.get("tensor_parallel_size") or 1))
    read = sum(est.from_stats(s).read_bytes for _, s in steps)
    return read / HBM_BYTES_PER_S / max(num_engines, 1)


@dataclass
class Runs:
    """What timed_runs measured; "plain" is the timed run of the workload as given."""
    by_name: dict            # run name -> (elapsed s, outputs)
    client_cpu_s: float      # this process's CPU time during the plain run
    engines: list[dict]      # engine_report of the plain run
    preemptions: int
    structured: dict | None  # bench/structured.py's report, with --structured-output
    steps: list              # (timestamp, SchedulerStats) of every engine step of the plain run

    @property
    def plain(self) -> tuple[float, list]:
        return self.by_name["plain"]


def timed_runs(llm, wl, args: argparse.Namespace, vocab: int | None, profiler_dir: str | None) -> Runs:
    """A warm-up, then the workload once per --sampling mode (the plain run traced under
    --profile-dir), then the --structured-output runs."""
    from frontend import SamplingParams
    if not args.no_warmup:
        warm = [[(7 * i + 3) % (vocab or 1000) for i in range(16)]]
        llm.generate(warm, SamplingParams(temperature=args.temperature, max_tokens=16, ignore_eos=True),
                     use_tqdm=False)
    modes = ["plain"] + [m for m in dict.fromkeys(args.sampling) if m != "plain"]
    by_name, client_cpu, engines, steps = {}, 0.0, [], []
    for mode in modes:
        for name, prompts, params in sampling_runs(mode, wl, args.temperature):
            before = engine_snapshot(llm.stats)
            if name == "plain":
                llm.stats.step_log = steps = []
            traced = name == "plain" and profiler_dir
            if traced:
                llm.start_profile("throughput")
            t0, cpu0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=args.progress)
            by_name[name] = (time.perf_counter() - t0, outs)
            if traced:
                llm.stop_profile()
            if name == "plain":
                llm.stats.step_log = None
                client_cpu = time.process_time() - cpu0
                engines = engine_report(before, engine_snapshot(llm.stats), t0)
    structured = None
    if args.structured_output:
        from bench.structured import run as run_structured
        elapsed, outs = by_name["plain"]
        output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        structured = run_structured(llm, wl, args, {"output_tokens": output_tokens,
                                                    "output_tok_per_s": output_tokens / elapsed,
                                                    "steps": engines[0]["steps"] if engines else 1})
    return Runs(by_name, client_cpu, engines, llm.stats.num_preemptions, structured, steps)


def report(args: argparse.Namespace, wl, runs: Runs, opts: dict, startup: float) -> dict:
    """Print the plain run's numbers; the JSON result."""
    elapsed, outs = runs.plain
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ok = (prompt_tokens, output_tokens) == (wl.prompt_tokens, wl.output_tokens)
    result = {
        "model": common.model_label(args),
        "workload": "offline-default" if wl.is_default else "custom",
        "num_requests": len(outs),
        "shard": args.shard,
        "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
        "temperature": args.temperature,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "expected_prompt_tokens": wl.prompt_tokens, "expected_output_tokens": wl.output_tokens,
        "totals_ok": ok,
        "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (prompt_tokens + output_tokens) / elapsed,
        "num_preemptions": runs.preemptions,
        "client_cpu_s": runs.client_cpu_s,
        "engines": runs.engines,
        "startup_s": startup,
        "structured_output": runs.structured,
        "engine_options": opts,
        "env": common.environment(),
    }
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['output_tok_per_s']:.2f} output tok/s, {result['total_tok_per_s']:.2f} total tok/s")
    print(f"Tokens: {prompt_tokens} prompt + {output_tokens} output in {elapsed:.2f} s "
          f"({runs.preemptions} preemptions)")
    print(f"Client process CPU: {runs.client_cpu_s:.2f} s in {elapsed:.2f} s "
          f"({1e6 * runs.client_cpu_s / max(output_tokens, 1):.1f} us per output token)")
    for e in runs.engines:
        print(f"Engine {e['engine']}: {e['steps']} steps, {e['output_tokens']} output tokens, last output at "
              f"{e['last_output_s']:.2f} s ({1e3 * e['last_output_s'] / max(e['steps'], 1):.2f} ms per step)")
    if wl.is_default:
        print(f"Standard workload totals (142,827 prompt / 133,966 output): {'OK' if ok else 'MISMATCH'}")
    elif not ok:
        print(f"Token totals MISMATCH: expected {wl.prompt_tokens} prompt / {wl.output_tokens} output")
    if len(runs.by_name) > 1:
        result["sampling"] = sampling_report(runs.by_name)
    if opts.get("profiler_dir"):
        print_kernel_time(opts["profiler_dir"], runs.engines[0]["steps"] if runs.engines else 1)
    return result


def compare_hf(args: argparse.Namespace, wl, mdir: str, opts: dict, output_tok_per_s: float) -> dict:
    """HF transformers' generate() on the workload's mean lengths (--compare-hf)."""
    from bench.hf import hf_generate_bench
    n = len(wl)
    in_len = args.input_len if args.input_len is not None else round(wl.prompt_tokens / n)
    out_len = args.output_len if args.output_len is not None else round(wl.output_tokens / n)
    if args.input_len is None or args.output_len is None:
        print(f"HF baseline on the mean lengths: {n} x {in_len} in / {out_len} out")
    hf = hf_generate_bench(mdir, n, in_len, out_len, dtype=opts["dtype"], device=opts["device"],
                           seed=args.seed, temperature=args.temperature)
    speedup = output_tok_per_s / hf["output_tok_per_s"]
    print(f"HF transformers generate: {hf['output_tok_per_s']:.2f} output tok/s "
          f"(batch {n}, {in_len} in / {out_len} out, {hf['elapsed_s']:.2f} s)")
    print(f"Loom / HF output tok/s: {speedup:.2f}x")
    return {"hf": hf, "speedup_vs_hf": speedup}
