"""`loom bench step-host`: the worker's host time per decode step, without the engine.

Drives a ModelRunner as the worker loop does (decode the step message, launch
step N+1 behind step N, then finish N and encode its output) on --batch
requests of --context prompt tokens, and prints the host milliseconds per step
in each phase, the wall time per step, and the torch operators the host calls
per step. When the wall time is the host's sum, the device waits for the host:
every operator, copy and Python line of the step is on the critical path
(bench/RESULTS.md, session 8: Qwen3-0.6B batch 1).

    loom bench step-host --preset qwen3-0.6b --batch 1 --steps 300 --profile 25
"""
from __future__ import annotations

import argparse
import time

from bench import common


def add_parser(sub) -> None:
    p = sub.add_parser("step-host", help="the worker's host time per decode step (no engine)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--batch", type=int, default=1, help="decoding requests")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps (after 50 untimed ones)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="top-k of every request (0: off; with top-k or top-p "
                                                        "the step samples eagerly after the decode graph)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of every request (1: off)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also: the N functions with the most own time per step (cProfile), and the "
                        "torch operators per step (torch.profiler, host side)")
    p.add_argument("--profile-steps", type=common.positive_int, default=100, metavar="S",
                   help="steps each of the two profiles of --profile runs (default 100)")
    p.set_defaults(func=main)


class _Requests:
    """SchedulerOutputs for --batch requests: one prefill step, then decode steps, each
    with the block a request crosses into, as the scheduler sends them."""

    def __init__(self, args, block_size: int, vocab: int):
        self.n, self.prompt, self.bs = args.batch, args.context, block_size
        self.ids = [f"r{i}" for i in range(self.n)]
        self.next_block = 0
        self.computed = 0
        self.vocab = vocab

    def _blocks(self, upto_tokens: int, have: int) -> list[int]:
        need = -(-upto_tokens // self.bs) - have
        out = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(out)
        return out

    def prefill(self, args):
        from ipc.messages import CachedRequestData, NewRequestData, SchedulerOutput
        from ipc.sampling_params import SamplingParams
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=1 << 20, ignore_eos=True)
        new = [NewRequestData(rid, [(7 * i + j) % self.vocab for j in range(self.prompt)], params,
                              self._blocks(self.prompt + 1, 0), 0, seed=i)
               for i, rid in enumerate(self.ids)]
        self.computed = self.prompt
        return SchedulerOutput(new, CachedRequestData(), list(self.ids), [self.prompt] * self.n)

    def decode(self):
        from ipc.messages import CachedRequestData, SchedulerOutput
        have = -(-(self.computed) // self.bs)
        blocks = [self._blocks(self.computed + 1, have) for _ in self.ids]
        cached = CachedRequestData(list(self.ids), blocks, [self.computed] * self.n)
        self.computed += 1
        return SchedulerOutput([], cached, list(self.ids), [1] * self.n)


def main(args: argparse.Namespace) -> int:
    import torch

    from ipc.serial import Decoder, Encoder
    from ipc.config import EngineConfig
    from ipc.messages import MsgType, SchedulerOutput, WorkerReply
    from workers.model_runner import ModelRunner
    from workers.models.registry import multimodal_info

    with common.model_dir(args) as mdir:
        config = EngineConfig(model=mdir, load_format="dummy" if args.preset else "auto", device=args.device,
                              max_model_len=args.context + args.steps + 2 * args.profile_steps + 128,
                              max_num_seqs=max(args.batch, 8),
                              enforce_eager=args.enforce_eager).resolve(multimodal_info)
        runner = ModelRunner(config)
        runner.initialize_cache(runner.determine_num_blocks())
    reqs = _Requests(args, config.block_size, runner.model.config.vocab_size)
    enc, dec = Encoder(), Decoder(SchedulerOutput)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    phases = {"decode msg": 0.0, "launch": 0.0, "finish": 0.0, "encode out": 0.0}

    def step(pending, timed: bool):
        frames = enc.encode(MsgType.WORKER_STEP.value, reqs.decode())
        t0 = time.perf_counter()
        so = dec.decode(frames)
        t1 = time.perf_counter()
        launched = runner.launch(so, pending)
        t2 = time.perf_counter()
        out = runner.finish(pending)
        t3 = time.perf_counter()
        enc.encode(MsgType.WORKER_REPLY.value, WorkerReply(0, output=out))
        t4 = time.perf_counter()
        if timed:
            for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k] += dt
        return launched

    pending = runner.launch(reqs.prefill(args))
    for _ in range(50):
        pending = step(pending, False)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        pending = step(pending, True)
    runner.finish(pending)
    wall = time.perf_counter() - t0
    ms = lambda s: 1e3 * s / args.steps
    host = sum(phases.values())
    print(f"{common.model_label(args)}, batch {args.batch}, context {args.context}, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}"
          f"{f', top-k {args.top_k}' if args.top_k else ''}{f', top-p {args.top_p}' if args.top_p < 1 else ''}, "
          f"{runner.device}, "
          f"{'decode graphs' if runner.decode_graphs else 'eager'}: {args.steps} decode steps")
    print(f"  wall {ms(wall):.3f} ms per step; host {ms(host):.3f} ms ("
          + ", ".join(f"{k} {ms(v):.3f}" for k, v in phases.items()) + ")")
    if args.profile:
        _profile(lambda p: step(p, False), pending, args, runner)
    return 0


def _profile(step, pending, args, runner) -> None:
    """cProfile's top functions by own time, then the host's torch operators, per step."""
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile
    n = args.profile_steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        pending = step(pending)
    prof.disable()
    print(f"\ncProfile, {n} steps (ms are totals over them):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(n):
            pending = step(pending)
    rows = sorted(((e.count / n, e.self_cpu_time_total / n, e.key) for e in tp.key_averages()
                   if e.self_cpu_time_total), key=lambda r: -r[1])
    print(f"torch operators per step (host side, under the profiler): {sum(r[0] for r in rows):.0f} calls")
    for calls, us, key in rows[:args.profile]:
        print(f"  {calls:6.1f} x  {us:8.1f} us own  {key}")
    runner.finish(pending)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
