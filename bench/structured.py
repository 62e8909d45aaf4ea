"""`loom bench throughput --structured-output json`: the same workload under a JSON schema, in
the same engine, and the step time of running requests while new schemas compile.

The schema is an endless linked list of notes ({"note": "...", "next": {...}}, "next" required
at every level), a JSON document that cannot end: with ignore_eos every constrained request runs
to its max_tokens exactly like the unconstrained run, so the two rates compare the same token
counts. (A string with a huge minLength would do too, but xgrammar's counted repetition costs
~5x more per token than its unbounded states.) The compile check runs a batch of free decodes twice, once
alone and once while requests with large new schemas (each compiled on the engine's grammar
thread) arrive beside them; the time per step should not change.
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
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=args.progress)
    elapsed = time.perf_counter() - t0
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
    result["compile_stall"] = compile_stall(llm, wl, args)
    return result


def compile_stall(llm, wl, args, batch: int = 64, steps: int = 384, schemas: int = 8) -> dict:
    """Seconds per step of `batch` free decodes alone, then while `schemas` new schemas compile."""
    from frontend import SamplingParams
    from ipc.sampling_params import StructuredOutputsParams

    prompts = [p[:64] for p in wl.prompts[:batch]]
    free = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=steps)

    def timed(extra: list) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts + [wl.prompts[0][:8]] * len(extra), [free] * len(prompts) + extra, use_tqdm=False)
        return (time.perf_counter() - t0) / steps

    base = timed([])
    # A/B: the same number of constrained requests, their schemas compiled already (cached by
    # source) vs new: the difference is what compiling costs the other requests' steps.
    cached = [SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=big_schema(i + 1000)))
              for i in range(schemas)]
    timed(cached)  # compiles them
    with_cached = timed(cached)
    compiling = [SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=big_schema(i)))
                 for i in range(schemas)]
    t0 = time.perf_counter()
    with_compiles = timed(compiling)
    wall = time.perf_counter() - t0
    compile_s = _compile_time([big_schema(i + 100) for i in range(2)], llm)
    print(f"Grammar compile stall: {1e3 * base:.2f} ms/step alone, {1e3 * with_cached:.2f} ms/step with {schemas} "
          f"constrained requests whose grammars are cached, {1e3 * with_compiles:.2f} ms/step while their "
          f"{schemas} new schemas compile ({100 * (with_compiles / with_cached - 1):+.1f}% from compiling; target "
          f"unchanged); one such schema compiles in ~{compile_s:.2f} s (here, in this process), the run took {wall:.1f} s")
    return {"s_per_step_alone": base, "s_per_step_cached": with_cached, "s_per_step_compiling": with_compiles,
            "schemas": schemas,
            "compile_s_each": compile_s}


def _compile_time(schemas: list[dict], llm) -> float:
    """Mean seconds to compile one schema like those above, for scale (in the bench process)."""
    import xgrammar as xgr
    from engine_core.structured_output import json_schema_grammar
    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=max(llm.config.vocab_size, len(llm.tokenizer)))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    import json
    t0 = time.perf_counter()
    for s in schemas:
        compiler.compile_grammar(json_schema_grammar(json.dumps(s), True))
    return (time.perf_counter() - t0) / len(schemas)
