"""`python -m bench.trace_steps TRACE.json`: where a served decode step's device time goes.

Reads a worker's torch-profiler trace (`loom bench latency --profiler-dir DIR`, or
/start_profile and /stop_profile on a server) and splits each decode step, from the
first kernel of one step's decode CUDA graphs to the first kernel of the next step's, into: the
graphs' kernels, every other device operation by name (copies, the lm_head, sampling), and the
time the device sat idle in between. Averages the middle steps (the first and last
--skip steps of the trace are left out) and lists the operations of one typical step
in order, with the idle gap before each.

    python -m bench.trace_steps /tmp/prof/loom_dp0_tp0_rank0.*.pt.trace.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: str) -> tuple[list[dict], set[int]]:
    """(the device operations sorted by start, the correlation ids of CUDA graph launches)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ops = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    graph_launches = {e["args"]["correlation"] for e in events
                      if e.get("cat") == "cuda_runtime" and e.get("name", "").startswith("cudaGraphLaunch")}
    return ops, graph_launches


def _graph_launch(op: dict, graph_launches: set[int]) -> int | None:
    """The correlation id of the graph launch that ran op, or None (an op launched on its own)."""
    c = op.get("args", {}).get("correlation")
    return c if c in graph_launches else None


def split_steps(ops: list[dict], graph_launches: set[int]) -> list[list[dict]]:
    """The operations from each step's first graph kernel to the next step's. A step replays the
    model graph and, when it samples there, the head graph right after it (workers/decode_graphs.py):
    a graph launch begins a new step only after an operation outside the graphs (the inputs' copy)."""
    steps, after_graph = [], False
    for op in ops:
        in_graph = _graph_launch(op, graph_launches) is not None
        if in_graph and not after_graph:
            steps.append([])
        after_graph = in_graph
        if steps:
            steps[-1].append(op)
    return steps[:-1]  # the last one has no end


def summarize(step: list[dict], graph_launches: set[int], nxt: float) -> dict[str, float]:
    """us per category of one step: 'graph', each other operation's name, 'idle'."""
    out: dict[str, float] = defaultdict(float)
    busy_until = step[0]["ts"]
    for op in step:
        name = "graph" if _graph_launch(op, graph_launches) is not None else op["name"][:80]
        out[name] += op["dur"]
        out["idle"] += max(0.0, op["ts"] - busy_until)
        busy_until = max(busy_until, op["ts"] + op["dur"])
    out["idle"] += max(0.0, nxt - busy_until)
    out["step"] = nxt - step[0]["ts"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a worker's .pt.trace.json")
    p.add_argument("--skip", type=int, default=5, help="steps left out at each end")
    args = p.parse_args()
    ops, graph_launches = load(args.trace)
    steps = split_steps(ops, graph_launches)
    if len(steps) <= 2 * args.skip:
        raise SystemExit(f"{len(steps)} decode graph steps in the trace: too few")
    middle = range(args.skip, len(steps) - args.skip)
    per = [summarize(steps[i], graph_launches, steps[i + 1][0]["ts"]) for i in middle]
    names = sorted({k for s in per for k in s}, key=lambda k: -statistics.mean(s.get(k, 0.0) for s in per))
    print(f"{len(per)} decode steps (of {len(steps)}), us per step (mean; median step "
          f"{statistics.median(s['step'] for s in per):.1f} us):")
    for k in names:
        vals = [s.get(k, 0.0) for s in per]
        print(f"  {statistics.mean(vals):9.1f}  {k}")
    typical = steps[middle[len(middle) // 2]]
    graph_end = max(op["ts"] + op["dur"] for op in typical if _graph_launch(op, graph_launches) is not None)
    print("\none step after its graph (us: idle gap before, duration, name):")
    t = graph_end
    for op in typical:
        if _graph_launch(op, graph_launches) is not None:
            continue
        print(f"  {op['ts'] - t:8.1f} {op['dur']:8.1f}  {op['name'][:90]}")
        t = max(t, op["ts"] + op["dur"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
