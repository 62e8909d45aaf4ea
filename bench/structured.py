"""`loom bench throughput --structured-output json`: the same workload under a JSON schema, in
the same engine, and the step time of running requests while new schemas compile.

The schema is an endless linked list of notes ({"note": "...", "next": {...}}, "next" required
at every level), a JSON document that cannot end: with ignore_eos every constrained request runs
to its max_tokens exactly like the unconstrained run, so the two rates compare the same token
counts. (A string with a huge minLength would do too, but xgrammar's counted repetition costs
~5x more per token than its unbounded states.) The compile check runs a batch of free decodes
alone, beside constrained requests whose grammars are cached, and while requests with large new
schemas (each compiled on the engine's grammar thread) wait beside them; the time per step of the
free requests should not change (compile_stall says how it is measured).
"""
from __future__ import annotations

import time

ENDLESS_SCHEMA = {"$defs": {"node": {"type": "object", "properties": {"note": {"type": "string"},
                                                                    "next": {"$ref": "#/$defs/node"}},
                                     "required": ["note", "next"]}},
                  "$ref": "#/$defs/node"}


def big_schema(i: int, n_props: int = 120) -> dict:
    """A schema xgrammar takes a while to compile (distinct per i, so no cache hit)."""
    props = {}
    for k in range(n_props):
        j = (i * 7919 + k) % 97
        props[f"f{i}_{k}"] = ({"type": "string", "pattern": f"[a-z]{{{j % 5 + 1},{j % 5 + 12}}}-[0-9]{{2,{j % 7 + 3}}}"}
                              if k % 3 == 0 else
                              {"type": "integer", "minimum": -j * 13, "maximum": j * 1000 + 7} if k % 3 == 1 else
                              {"type": "array", "items": {"type": "string", "enum": [f"v{j}_{m}" for m in range(8)]},
                               "maxItems": j % 6 + 2})
    return {"type": "object", "properties": props, "required": list(props)[: n_props // 2]}


def run(llm, wl, args, unconstrained: dict) -> dict:
    from frontend import SamplingParams
    from ipc.sampling_params import StructuredOutputsParams

    constraint = StructuredOutputsParams(json=ENDLESS_SCHEMA)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m,
                             structured_outputs=constraint) for m in wl.max_tokens]
    llm.generate(wl.prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True, structured_outputs=constraint),
                 use_tqdm=False)   # warm-up: the tokenizer info and this grammar compile once
    profiler_dir = getattr(args, "profiler_dir", None)
    if profiler_dir:   # --profiler-dir traces this run too: where the constrained steps wait
        llm.start_profile("structured")
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=args.progress)
    elapsed = time.perf_counter() - t0
    if profiler_dir:
        llm.stop_profile()
        _print_trace(profiler_dir, unconstrained)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    rate = tokens / elapsed
    same = tokens == unconstrained["output_tokens"]
    # from the token ids: the detokenizer's first delta can carry the undecodable tail of a random prompt
    bad = sum(not llm.tokenizer.decode(c.token_ids[:4]).lstrip().startswith("{") for o in outs for c in o.outputs)
    print(f"Structured output (json schema): {rate:.2f} output tok/s vs {unconstrained['output_tok_per_s']:.2f} "
          f"unconstrained = {100 * rate / unconstrained['output_tok_per_s']:.1f}% (target >= 85%); "
          f"{tokens} output tokens ({'same counts: OK' if same else 'MISMATCH'}); "
          f"{bad} outputs off the schema")
    result = {"output_tokens": tokens, "elapsed_s": elapsed, "output_tok_per_s": rate,
              "ratio": rate / unconstrained["output_tok_per_s"], "same_token_counts": same, "off_schema": bad}
    if not getattr(args, "skip_compile_stall", False):
        result["compile_stall"] = compile_stall(llm, wl, args)
    return result


def _print_trace(profiler_dir: str, unconstrained: dict) -> None:
    """The traced constrained run's kernels and host CUDA calls per step, beside the plain run's."""
    from bench.kernel_trace import kernel_table, newest_trace, runtime_table
    steps = max(1, unconstrained.get("steps", 1))
    for prefix in ("throughput", "structured"):
        trace = newest_trace(profiler_dir, prefix)
        if trace is None:
            print(f"no {prefix} trace in {profiler_dir}")
            continue
        print(f"--- {prefix} run (traced)")
        print("\n".join(kernel_table(trace, per=steps, unit="step", top=8) + runtime_table(trace, per=steps, unit="step")))


def compile_stall(llm, wl, args, batch: int = 64, steps: int = 384, schemas: int = 8, rounds: int = 2) -> dict:
    """The step time of `batch` free decodes while `schemas` new schemas compile, vs beside the same
    number of constrained requests whose grammars are cached (and alone).

    The claim is about the other requests' steps, so it is measured on the engine's own step
    timestamps, on the steps that ran exactly the free batch: a constrained request joins in a step
    with its prefill (eager, several times a decode step), which it costs cached or not. Cached, the
    8 join with the free batch's prefill; compiling, each joins when its grammar is in, in a step of
    its own, so the whole-run time per step (also printed) adds ~7 such steps to the compile's
    account. The comparison is made at the same decode positions (the same context lengths)."""
    from frontend import SamplingParams
    from ipc.sampling_params import StructuredOutputsParams

    prompts = [p[:64] for p in wl.prompts[:batch]]
    batch = len(prompts)
    free = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=steps)

    join_steps = {"cached": 0, "compiling": 0}

    def timed(extra: list, mode: str | None = None) -> tuple[float, dict]:
        llm.stats.step_log = log = []
        t0 = time.perf_counter()
        try:
            llm.generate(prompts + [wl.prompts[0][:8]] * len(extra), [free] * len(prompts) + extra, use_tqdm=False)
        finally:
            llm.stats.step_log = None
        if mode is not None:   # steps with a prefill once the free batch decodes: the constrained requests joining
            first = next((i for i, (_, s) in enumerate(log) if s.num_scheduled_tokens == batch
                          and s.num_prompt_tokens == 0), len(log))
            join_steps[mode] += sum(s.num_prompt_tokens > 0 for _, s in log[first:])
        return (time.perf_counter() - t0) / steps, decode_steps(log, batch)

    def constrained(base: int) -> list:
        return [SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=big_schema(base + i)))
                for i in range(schemas)]

    timed(constrained(1000))  # compiles the cached set
    alone_s, alone = timed([])
    whole = {"cached": [], "compiling": []}
    per_step = {"cached": {}, "compiling": {}}
    for r in range(rounds):   # alternate, so that a drift biases neither
        for mode, base in (("cached", 1000), ("compiling", 100 * r)):
            w, ds = timed(constrained(base), mode)
            whole[mode].append(w)
            for pos, (dt, compiling) in ds.items():
                if mode == "cached" or compiling:
                    per_step[mode].setdefault(pos, []).append(dt)
    positions = sorted(set(per_step["compiling"]) & set(per_step["cached"]) & set(alone))

    def mean_ms(d: dict) -> float:
        xs = [x for pos in positions for x in d[pos]]
        return 1e3 * sum(xs) / max(1, len(xs))

    a = mean_ms({pos: [dt] for pos, (dt, _) in alone.items()})
    c, k = mean_ms(per_step["cached"]), mean_ms(per_step["compiling"])
    if not positions:   # every schema compiled before the free batch's prefill was done
        print("Grammar compile stall: no step of the free batch ran while a schema compiled (compiles too fast here)")
        c = k = float("nan")
    w_c, w_k = 1e3 * sum(whole["cached"]) / rounds, 1e3 * sum(whole["compiling"]) / rounds
    compile_s = _compile_time([big_schema(i + 100_000) for i in range(2)], llm)
    print(f"Grammar compile stall, per step of the {batch} other requests (engine step timestamps, {len(positions)} "
          f"decode positions while {schemas} schemas compile, x{rounds}): {a:.3f} ms alone, {c:.3f} ms beside {schemas} "
          f"constrained requests whose grammars are cached, {k:.3f} ms while their new schemas compile: "
          f"{100 * (k / c - 1):+.1f}% from compiling (target: unchanged). Whole run incl. the constrained requests' "
          f"own join steps: {1e3 * alone_s:.2f} ms/step alone, {w_c:.2f} cached, {w_k:.2f} compiling "
          f"({100 * (w_k / w_c - 1):+.1f}%; they joined in {join_steps['cached'] / rounds:.1f} steps of their own "
          f"cached, {join_steps['compiling'] / rounds:.1f} compiling); one such schema compiles in ~{compile_s:.2f} s "
          f"(in this process)")
    return {"ms_per_step_alone": a, "ms_per_step_cached": c, "ms_per_step_compiling": k, "positions": len(positions),
            "whole_run_ms_per_step": {"alone": 1e3 * alone_s, "cached": w_c, "compiling": w_k},
            "join_steps_per_run": {m: n / rounds for m, n in join_steps.items()},
            "schemas": schemas, "compile_s_each": compile_s}


def decode_steps(log: list, batch: int) -> dict[int, tuple[float, bool]]:
    """{decode position: (seconds, whether a grammar was compiling)} of the steps that ran exactly
    the free batch, from the engine's per-step (timestamp, SchedulerStats). A step's time is the
    gap since the previous step's report; a step is kept only if it and its two neighbours on
    each side scheduled `batch` tokens and no prompt tokens (a joining request's prefill step
    shows in the gap after it, as the steps are pipelined). A request waiting in the scheduler
    (num_waiting) is one whose grammar is compiling: the free requests are all running by then."""
    pure = [s.num_scheduled_tokens == batch and s.num_prompt_tokens == 0 for _, s in log]
    first = next((i for i, p in enumerate(pure) if p), len(log))
    out = {}
    for i in range(max(first, 2), len(log) - 2):
        if all(pure[i - 2:i + 3]):
            out[i - first] = (log[i][0] - log[i - 1][0], log[i][1].num_waiting > 0)
    return out


def _compile_time(schemas: list[dict], llm) -> float:
    """Mean seconds to compile one schema like those above, for scale (in the bench process)."""
    import xgrammar as xgr
    from ipc.grammar import json_schema_grammar
    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=max(llm.config.vocab_size, len(llm.tokenizer)))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    import json
    t0 = time.perf_counter()
    for s in schemas:
        compiler.compile_grammar(json_schema_grammar(json.dumps(s), True))
    return (time.perf_counter() - t0) / len(schemas)
