"""Does compiling a grammar slow the engine loop? A CPU measurement, no GPU and no model weights.

`python -m bench.grammar_stall [--preset qwen3-0.6b]`: a stand-in for the engine core's busy loop
runs on one thread of this process. Each iteration is one "step": a fixed amount of Python work
(--work-us, the scheduler's share) and then a GIL-free wait for the "device" (--device-ms, like the
loop's poll on the workers' reply). The loop also does what the scheduler does for constrained
requests: StructuredOutputManager.add_request (the engine's own code path: its thread pool,
xgrammar compiler, cache by source) and ready() every step until each grammar is in, which makes
the request's matcher. The time per step is measured

  alone      - no constrained request;
  cached     - N constrained requests whose grammars are already cached;
  compiling  - N new schemas compiling on the manager's pool (the engine's case);
  process    - the same compile work in a child process instead, N new schemas: the CPU it takes
               from the loop without sharing its GIL.

Steps that made a matcher (a request joining) are left out of the per-step time and counted
apart: that cost is the constrained request's own, cached or not. "compiling" vs "cached" is what
compiling costs the other requests; "compiling" vs "process" is what the GIL adds to plain CPU
contention. Rounds alternate the modes so that a noisy machine biases none of them.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.grammar_stall", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b", help="the tokenizer of this preset (bench/presets.py)")
    p.add_argument("--schemas", type=int, default=8, help="constrained requests (new schemas) per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every mode, interleaved")
    p.add_argument("--steps", type=int, default=200, help="steps per mode per round (more while something compiles)")
    p.add_argument("--work-us", type=float, default=300.0, help="Python work of one step, microseconds")
    p.add_argument("--device-ms", type=float, default=1.7, help="GIL-free wait of one step, milliseconds")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this run (default: Python's 0.005 s)")
    return p.parse_args(argv)


def calibrate(work_us: float) -> int:
    """Units of scheduler-like Python work (dict and attribute updates) that take work_us here, alone."""
    n = 1000
    while True:
        t0 = time.perf_counter()
        python_work(n)
        el = time.perf_counter() - t0
        if el > 0.02:
            return max(1, int(n * work_us * 1e-6 / el))
        n *= 2


def python_work(n: int) -> int:
    reqs = [SimpleNamespace(computed=0, placeholders=0) for _ in range(64)]
    sched = {}
    for i in range(n):
        r = reqs[i & 63]
        r.computed += 1
        sched[i & 63] = r.computed + r.placeholders
    return len(sched)


def _request(i: int, schema: dict):
    from ipc.sampling_params import SamplingParams, StructuredOutputsParams
    return SimpleNamespace(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], output_token_ids=[], eos_token_ids=[0],
                           grammar=None, sampling_params=SamplingParams(
                               max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema)))


def _compile_child(conn, config) -> None:
    """The 'process' mode: StructuredOutputManager compiles on its own pool, as in the engine,
    but in a process of its own (it shares the CPU with the loop, not the GIL)."""
    from engine_core.structured_output import StructuredOutputManager
    mgr = StructuredOutputManager(config)
    warm = _request(0, {"type": "object"})
    mgr.add_request(warm)
    warm.grammar.future.result()
    conn.send("ready")
    while True:
        schemas = conn.recv()
        if schemas is None:
            mgr.shutdown()
            return
        for i, s in enumerate(schemas):
            req = _request(i, s)
            mgr.add_request(req)
            req.grammar.future.exception()
            conn.send("one")


class Loop:
    """The busy loop's stand-in: runs steps on its own thread, one mode at a time."""

    def __init__(self, args, mgr, units: int):
        self.args, self.mgr, self.units = args, mgr, units

    def run(self, requests: list, child=None, n_child: int = 0, window: bool = False) -> dict:
        """Step --steps times, and on until every grammar is in; requests join as their grammars
        get ready (ready() every step, as the scheduler does).
        Returns the per-step times of steps that made no matcher (with `window`: only those
        while something was compiling)."""
        result = {}
        t = threading.Thread(target=self._steps, args=(requests, child, n_child, window, result), name="busy-loop")
        t.start()
        t.join()
        return result

    def _steps(self, requests, child, n_child, window, result) -> None:
        for r in requests:
            self.mgr.add_request(r)
        waiting = list(requests)
        pending_child = n_child
        plain, joins, window_end = [], [], None
        device = self.args.device_ms * 1e-3
        last = time.perf_counter()
        step = 0
        while step < self.args.steps or waiting or pending_child:
            step += 1
            python_work(self.units)
            joined = False
            still = []
            for r in waiting:
                if self.mgr.ready(r):
                    joined = True
                    self.mgr.grammar_bitmask(SimpleNamespace(req_ids=[r.request_id]), {r.request_id: r})
                else:
                    still.append(r)
            waiting = still
            while child is not None and pending_child and child.poll():
                child.recv()
                pending_child -= 1
            time.sleep(device)          # the device step (the loop waits with the GIL released)
            now = time.perf_counter()
            (joins if joined else plain).append(now - last)
            last = now
            busy = bool(waiting) or pending_child > 0
            if window_end is None and not busy:
                window_end = len(plain)
        result["plain"] = plain[:window_end] if window else plain
        result["joins"] = joins


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    from bench.presets import write_preset
    from ipc.config import EngineConfig
    from workers.models.registry import multimodal_info

    with tempfile.TemporaryDirectory(prefix="loom-grammar-stall-") as model_dir:
        config = EngineConfig(model=write_preset(args.preset, model_dir), load_format="dummy").resolve(multimodal_info)
        return measure(args, config)


def measure(args, config) -> dict:
    from bench.structured import big_schema
    from engine_core.structured_output import StructuredOutputManager

    mgr = StructuredOutputManager(config)
    units = calibrate(args.work_us)
    loop = Loop(args, mgr, units)
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_compile_child, args=(child_end, config), daemon=True)
    child.start()

    cached = [_request(i, big_schema(10_000 + i)) for i in range(args.schemas)]
    loop.run(cached)                      # the tokenizer info, and these grammars into the cache
    assert parent.recv() == "ready"
    times = {m: [] for m in ("alone", "cached", "compiling", "process")}
    joins = {m: [] for m in times}
    serial = 0
    for _ in range(args.rounds):
        for mode in times:
            if mode == "alone":
                out = loop.run([])
            elif mode == "cached":
                out = loop.run([_request(i, big_schema(10_000 + i)) for i in range(args.schemas)])
            elif mode == "compiling":
                serial += 1
                out = loop.run([_request(i, big_schema(serial * 1000 + i)) for i in range(args.schemas)], window=True)
            else:
                serial += 1
                parent.send([big_schema(serial * 1000 + i) for i in range(args.schemas)])
                out = loop.run([], child=parent, n_child=args.schemas, window=True)
            times[mode] += out["plain"]
            joins[mode] += out["joins"]
    parent.send(None)
    child.join(5)
    mgr.shutdown()

    def ms(xs):
        return 1e3 * statistics.fmean(xs) if xs else float("nan")

    report = {m: {"ms_per_step": ms(times[m]), "p90_ms": 1e3 * statistics.quantiles(times[m], n=10)[-1],
                  "steps": len(times[m]), "join_steps": len(joins[m]), "ms_per_join_step": ms(joins[m])}
              for m in times}
    base = report["cached"]["ms_per_step"]
    print(f"grammar stall (CPU stand-in, {args.preset} tokenizer, {args.schemas} schemas, "
          f"{args.work_us:.0f} us Python + {args.device_ms} ms wait per step, "
          f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms):")
    for m, r in report.items():
        print(f"  {m:10s} {r['ms_per_step']:.3f} ms/step (p90 {r['p90_ms']:.3f}, {r['steps']} steps; "
              f"{r['join_steps']} steps that made a matcher, {r['ms_per_join_step']:.3f} ms each)")
    print(f"  compiling vs cached: {100 * (report['compiling']['ms_per_step'] / base - 1):+.1f}%; "
          f"compile in a child process vs cached: {100 * (report['process']['ms_per_step'] / base - 1):+.1f}%")
    return report


if __name__ == "__main__":
    main()
