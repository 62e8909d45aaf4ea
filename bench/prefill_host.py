"""The host side of the shared-prefix workload's prefill steps (bench/cascade.py's shape), on the CPU.

    export PYTHONPATH=$PWD; python3 -m bench.prefill_host [--num-prompts 512] [--prefix-len 2048]
        [--own-len 64] [--runs 2] [--profile N]

A real Scheduler and a real ModelRunner (a tiny Qwen3 of dummy weights: the host work depends on
token and block counts, not on the model's width), with cascade.py's engine options (prefix
caching, max_num_seqs = the prompts, the default token budget 8,192, blocks of 16), driven step
by step as the engine and the worker do, with no forward and no sampler: each step's sampled
rows get a token of their own. Each run's prompts share a fresh prefix (--runs 2: cascade.py's
warm-up and timed runs). Until every request has run its prompt, per step and phase, in ms:

  schedule  Scheduler.schedule (the engine's critical path with async scheduling: the device
            runs the steps in flight meanwhile)
  encode    the step's message (the engine's ring write)
  decode    ... decoded (the worker)
  prepare   ModelRunner.prepare_host: the diff applied, the host inputs built
  stage     ModelRunner.stage: uploaded (here torch.from_numpy), the attention metadata
  cascade   CascadePlanner.prefix_len on the step's host block table (the GPU's planner; the
            CPU's runner has none)
  update    Scheduler.update_from_output of the step's output

--profile N: cProfile's N functions with the most own time over the prefill steps.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from bench.cascade import add_shape_args

# a Qwen3 as narrow as it gets: the runner's host work is the same as Qwen3-0.6B's
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
    "max_position_embeddings": 40960, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True, "torch_dtype": "float32",
    "vocab_size": 151936,
}
PHASES = ("schedule", "encode", "decode", "prepare", "stage", "cascade", "update")


def build(args):
    from engine_core.scheduler import Scheduler
    from ipc.config import EngineConfig
    from workers.cascade_attn import CascadePlanner
    from workers.model_runner import ModelRunner
    from workers.models.registry import multimodal_info
    mdir = tempfile.mkdtemp(prefix="loom-prefill-host-")
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(TINY_QWEN3, f)
    max_len = args.prefix_len + args.own_len + args.output_len + 16
    config = EngineConfig(model=mdir, load_format="dummy", device="cpu", max_model_len=max_len,
                          max_num_seqs=args.num_prompts, enable_prefix_caching=True, seed=0,
                          kv_cache_memory_bytes=1 << 30).resolve(multimodal_info)
    runner = ModelRunner(config)
    # the GPU's planner (its decision reads only the host block table): the CPU's runner has none
    planner = CascadePlanner(runner.model, config, runner.kv_spec.dtype, config.block_size)
    planner.mode = "auto"
    num_blocks = args.num_prompts * -(-max_len // config.block_size) + 64   # room for every request, as on the H200
    return config, runner, planner, Scheduler(config, num_blocks)


def prompts(rng: random.Random, args, vocab: int) -> list[list[int]]:
    shared = [rng.randrange(10, vocab) for _ in range(args.prefix_len)]
    return [shared + [rng.randrange(10, vocab) for _ in range(args.own_len)] for _ in range(args.num_prompts)]


def run(args, config, runner, planner, scheduler, rng, run_index: int, times: list[dict], profile=None):
    """One run's requests through schedule -> worker -> update until every prompt has run; its
    steps with new requests appended to `times` (ms per phase)."""
    import numpy as np

    from engine_core.request import Request
    from ipc.messages import EngineCoreRequest, ModelRunnerOutput, MsgType, SchedulerOutput
    from ipc.sampling_params import SamplingParams
    from ipc.serial import Decoder, Encoder
    enc, dec = Encoder(), Decoder(SchedulerOutput)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, p in enumerate(prompts(rng, args, TINY_QWEN3["vocab_size"] - 16)):
        scheduler.add_request(Request(EngineCoreRequest(f"r{run_index}-{i}", p, params, eos_token_ids=[151645]),
                                      config.max_model_len, i))
    token, decodes = 11, 0
    while (scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
           or decodes < args.decode_steps):
        t = {}
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        frames = enc.encode(MsgType.WORKER_STEP.value, so)
        frames = [bytes(f) for f in frames]
        t2 = time.perf_counter()
        so = dec.decode(frames)
        t3 = time.perf_counter()
        host_step = runner.prepare_host(so)
        t4 = time.perf_counter()
        batch = runner.stage(host_step, None)
        t5 = time.perf_counter()
        planner.prefix_len(batch.host.block_table, batch.computed_before, batch.num_scheduled)
        t6 = time.perf_counter()
        # the launch's bookkeeping and finish()'s, with a token per sampled row for the forward's
        for st, computed in zip(batch.states, batch.computed_after):
            st.num_computed_tokens = int(computed)
        sampled = [-1] * len(so.req_ids)
        for i in batch.sample_rows.tolist():
            sampled[i] = token
            runner.batch.append_token(batch.states[i], token)
        t7 = time.perf_counter()
        scheduler.update_from_output(ModelRunnerOutput(list(so.req_ids), sampled), so.step_id)
        t8 = time.perf_counter()
        if profile is not None:
            profile.disable()
        decodes += not so.new_requests
        if so.new_requests or (run_index == args.runs - 1 and args.decode_steps):
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5, t7), (t1, t2, t3, t4, t5, t6, t8)):
                t[name] = 1e3 * (b - a)
            t.update(run=run_index, kind="prefill" if so.new_requests else "decode", reqs=len(so.req_ids),
                     new=len(so.new_requests),
                     tokens=int(np.sum(so.num_scheduled_tokens)))
            times.append(t)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--runs", type=int, default=2, help="runs, each over a fresh prefix (cascade.py: warm-up, timed)")
    p.add_argument("--decode-steps", type=int, default=0, metavar="N",
                   help="also time the last run's first N steps after every prompt has run (decodes)")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    import gc

    from engine_core.request import RequestStatus
    from ipc.messages import CachedRequestData, SchedulerOutput
    config, runner, planner, scheduler = build(args)
    rng = random.Random(0)
    times: list[dict] = []
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    gc.collect()
    gc.freeze()   # (as the engine core and workers do after start-up)
    for r in range(args.runs):
        run(args, config, runner, planner, scheduler, rng, r, times, prof)
        # the run's requests finish (their decode steps are not timed here)
        scheduler.finish_requests([r.request_id for r in scheduler.running], RequestStatus.FINISHED_LENGTH)
        runner.prepare_host(SchedulerOutput([], CachedRequestData(), [], [], finished_req_ids=scheduler.finished_req_ids))
        scheduler.finished_req_ids = []
    print(f"{'run':>3s} {'kind':>7s} {'reqs':>5s} {'new':>4s} {'tokens':>6s} " + " ".join(f"{k:>8s}" for k in PHASES)
          + f" {'sum':>8s}")
    for t in times:
        print(f"{t['run']:3d} {t['kind']:>7s} {t['reqs']:5d} {t['new']:4d} {t['tokens']:6d} "
              + " ".join(f"{t[k]:8.2f}" for k in PHASES) + f" {sum(t[k] for k in PHASES):8.2f}")
    for kind in ("prefill", "decode"):
        timed = [t for t in times if t["run"] == args.runs - 1 and t["kind"] == kind]
        if not timed:
            continue
        mean = {k: sum(t[k] for t in timed) / len(timed) for k in PHASES}
        print(f"last run, mean of {len(timed)} {kind} steps: " + ", ".join(f"{k} {v:.2f}" for k, v in mean.items())
              + f"; engine (schedule+encode+update) {mean['schedule'] + mean['encode'] + mean['update']:.2f}, "
              f"worker (decode+prepare+stage+cascade) "
              f"{mean['decode'] + mean['prepare'] + mean['stage'] + mean['cascade']:.2f}")
    if prof is not None:
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"steps": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LOOM_LOG_LEVEL", "WARNING")
    raise SystemExit(main())
