"""`python -m bench.trace_gaps TRACE.json`: where a served worker's GPU sat idle, and what the
worker's host was doing when the work that ended each idle gap was queued.

Record the trace on a server started with LOOM_STEP_STATS=1 and --profiler-dir DIR (POST
/start_profile, then /stop_profile; or `loom bench latency --profiler-dir`): the step stats mark
the end of each step phase in the trace (workers/profiler.mark: loom.begin, loom.prepare,
loom.encoder, loom.forward, loom.sample, loom.end.KIND). For each gap between device operations
longer than --min-gap-us, the operation after it is traced back to its launch on the host
(the profiler's correlation id); the phase in progress then is the one whose end mark comes
next. A launch after the gap began means the host was late (the phase's host work set the pace);
a launch before it means the device waited on something else (a copy from pageable memory,
another stream, an event).

    python -m bench.trace_gaps /tmp/prof/loom_dp0_tp0_rank0.*.pt.trace.json
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from dataclasses import dataclass

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
BETWEEN = "between steps"   # after a step's end mark, before the next one's begin: finishing, receiving


@dataclass
class Gap:
    us: float           # the device's idle time
    op: str             # the device operation that ended it
    phase: str          # the host phase in progress when that operation was queued
    late_us: float | None   # how long after the gap began it was queued (None: no launch found)


def phase_at(marks: list[tuple[float, str]], t: float) -> str:
    """The phase in progress at host time t: the one whose end mark comes next."""
    i = bisect.bisect_left(marks, (t, ""))
    if i == len(marks):
        return "after the last mark"
    name = marks[i][1].removeprefix("loom.").removeprefix("end.")   # (end.encoder: the encoder's own stats)
    return BETWEEN if name == "begin" else name


def gaps(events: list[dict], min_gap_us: float) -> tuple[list[Gap], float, float]:
    """(the gaps, the device span, the device busy time), all in us."""
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    if not dev:
        return [], 0.0, 0.0
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    marks = sorted((e["ts"], e["name"]) for e in events
                   if e.get("cat") == "user_annotation" and e.get("name", "").startswith("loom."))
    out, end, busy = [], dev[0]["ts"], 0.0
    for e in dev:
        gap = e["ts"] - end
        if gap > min_gap_us:
            t = launched.get(e.get("args", {}).get("correlation"))
            out.append(Gap(gap, e["name"], phase_at(marks, t) if t is not None else "unknown",
                           None if t is None else t - end))
        busy += e["dur"]
        end = max(end, e["ts"] + e["dur"])
    return out, end - dev[0]["ts"], busy


def report(path: str, min_gap_us: float = 50.0, top: int = 10) -> list[str]:
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    found, span, busy = gaps(events, min_gap_us)
    idle = sum(g.us for g in found)
    lines = [f"device span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle in gaps over {min_gap_us:.0f} us: "
             f"{idle / 1e3:.1f} ms ({idle / max(span, 1):.1%}) in {len(found)} gaps"]
    by_phase: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])   # count, idle us, of which host late
    for g in found:
        row = by_phase[g.phase]
        row[0] += 1
        row[1] += g.us
        row[2] += g.us if g.late_us is not None and g.late_us > 0 else 0.0
    lines.append(f"{'host phase when the next op was queued':40s} {'gaps':>6s} {'idle ms':>9s} {'host late':>10s}")
    for phase, (n, us, late) in sorted(by_phase.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{phase:40s} {n:6d} {us / 1e3:9.1f} {late / 1e3:10.1f}")
    lines.append(f"the {min(top, len(found))} longest (ms, phase, queued after the gap began by ms, next op):")
    for g in sorted(found, key=lambda g: -g.us)[:top]:
        late = "?" if g.late_us is None else f"{g.late_us / 1e3:.2f}"
        lines.append(f"  {g.us / 1e3:7.2f}  {g.phase:14s} {late:>8s}  {g.op[:70]}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a worker's .pt.trace.json")
    p.add_argument("--min-gap-us", type=float, default=50.0, help="shorter gaps are not counted (default 50)")
    p.add_argument("--top", type=int, default=10, help="the longest gaps listed (default 10)")
    args = p.parse_args()
    print("\n".join(report(args.trace, args.min_gap_us, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
