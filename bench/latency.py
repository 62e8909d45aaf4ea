"""`loom bench latency`: one request at a time (batch 1).

For each (input, output) length pair: TTFT is the wall time of a request with
max_tokens=1 (prefill plus the first token, through LLM.generate), E2E that of
a request with max_tokens=output_len, and time per output token
TPOT = (E2E - TTFT) / (output_len - 1). Every request has a fresh random
prompt, so the prefix cache never helps. Medians over --iters after one
warm-up per pair. With --profiler-dir, one more request per pair runs under the
workers' torch profiler (read the trace with `python -m bench.trace_steps`).

    loom bench latency --preset qwen3-0.6b --input-len 128 1024 --output-len 128 1024
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench import common
from bench.workloads import fixed_workload


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="batch-1 latency: TTFT and time per output token",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--input-len", type=common.positive_int, nargs="+", default=[128],
                   help="prompt length(s); several run one after the other, paired with --output-len")
    p.add_argument("--output-len", type=common.positive_int, nargs="+", default=[128],
                   help="output length(s), paired with --input-len")
    p.add_argument("--iters", type=common.positive_int, default=5, help="timed runs per shape (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")
    p.add_argument("--output-json", default=None, help="write the results to this JSON file")
    common.add_engine_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from frontend import LLM, SamplingParams
    ins, outs = args.input_len, args.output_len
    if len(ins) == 1 and len(outs) > 1:
        ins = ins * len(outs)
    if len(outs) == 1 and len(ins) > 1:
        outs = outs * len(ins)
    if len(ins) != len(outs):
        raise SystemExit("--input-len and --output-len need the same number of values")
    if min(outs) < 2:
        raise SystemExit("--output-len must be at least 2")

    with common.model_dir(args) as mdir:
        opts = common.engine_options(args, mdir)
        vocab = common.read_model_config(mdir).get("vocab_size")
        longest = max(i + o for i, o in zip(ins, outs))
        if longest > opts["max_model_len"]:
            raise SystemExit(f"{longest} tokens per request exceed --max-model-len {opts['max_model_len']}")
        llm = LLM(mdir, **opts)
        runs = []
        try:
            for k, (n_in, n_out) in enumerate(zip(ins, outs)):
                # 2 prompts per iteration (TTFT, E2E) + 2 for the warm-up; all distinct
                prompts = fixed_workload(2 * args.iters + 2, n_in, 1, seed=args.seed + 1000 * k,
                                         vocab_size=vocab).prompts

                def timed(prompt, max_tokens):
                    sp = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
                    t0 = time.perf_counter()
                    out = llm.generate([prompt], sp, use_tqdm=False)
                    dt = time.perf_counter() - t0
                    got = len(out[0].outputs[0].token_ids)
                    if got != max_tokens:
                        raise RuntimeError(f"asked for {max_tokens} tokens, got {got}")
                    return dt

                timed(prompts[-2], 1)
                timed(prompts[-1], n_out)
                ttfts, e2es = [], []
                for it in range(args.iters):
                    ttfts.append(timed(prompts[2 * it], 1))
                    e2es.append(timed(prompts[2 * it + 1], n_out))
                if args.profiler_dir:  # one more request, traced (python -m bench.trace_steps reads it)
                    llm.start_profile(f"latency_{n_in}_{n_out}")
                    timed(prompts[-1], n_out)
                    llm.stop_profile()
                tpots = [(e - t) / (n_out - 1) for e, t in zip(e2es, ttfts)]
                ttft, e2e = statistics.median(ttfts), statistics.median(e2es)
                tpot = (e2e - ttft) / (n_out - 1)
                run = {"input_len": n_in, "output_len": n_out, "iters": args.iters,
                       "ttft_ms": 1000 * ttft, "tpot_ms": 1000 * tpot, "e2e_ms": 1000 * e2e,
                       "decode_tok_per_s": 1 / tpot if tpot > 0 else float("inf"),
                       "ttfts_ms": [1000 * x for x in ttfts], "e2es_ms": [1000 * x for x in e2es],
                       "tpots_ms": [1000 * x for x in tpots]}
                runs.append(run)
                print(f"batch 1, {n_in} in / {n_out} out: TTFT {run['ttft_ms']:.2f} ms, "
                      f"TPOT {run['tpot_ms']:.3f} ms ({run['decode_tok_per_s']:.1f} tok/s), "
                      f"E2E {run['e2e_ms']:.1f} ms (median of {args.iters})", flush=True)
        finally:
            llm.shutdown()

    print()
    print(f"{'input':>6} {'output':>6} {'TTFT ms':>10} {'TPOT ms':>10} {'E2E ms':>10} {'tok/s':>8}")
    for r in runs:
        print(f"{r['input_len']:>6} {r['output_len']:>6} {r['ttft_ms']:>10.2f} {r['tpot_ms']:>10.3f} "
              f"{r['e2e_ms']:>10.1f} {r['decode_tok_per_s']:>8.1f}")
    common.write_json(args.output_json, {"model": common.model_label(args), "runs": runs,
                                         "engine_options": opts, "env": common.environment()})
    return 0
