"""GPU time by kernel from a worker's torch-profiler trace (CUDA-graph replays included).

The engine's workers write chrome traces on /stop_profile (workers/profiler.py); this reads
rank 0's newest one and sums each kernel's device time, so a run's gap to its floor can be
read off by kernel: attention, GEMMs, norms, sampler, all-reduces.
"""
from __future__ import annotations

import glob
import json
import os


def newest_trace(profile_dir: str, prefix: str) -> str | None:
    traces = glob.glob(os.path.join(profile_dir, f"{prefix}_*rank0*.json"))
    return max(traces, key=os.path.getmtime) if traces else None


def kernel_table(path: str, per: int = 1, unit: str = "run", top: int = 14) -> list[str]:
    """Lines: kernels, their device time and idle gaps, then the `top` kernels by time,
    divided by `per` (tokens, steps; 1 = the whole trace)."""
    with open(path) as f:
        events = sorted((e for e in json.load(f).get("traceEvents", []) if e.get("cat") == "kernel"),
                        key=lambda e: e["ts"])
    if not events:
        return [f"no kernels in {path}"]
    by_name: dict[str, float] = {}
    idle, end = 0.0, events[0]["ts"]
    for e in events:
        dur = e.get("dur", 0.0)
        by_name[e["name"][:90]] = by_name.get(e["name"][:90], 0.0) + dur
        idle += max(e["ts"] - end, 0.0)  # the device ran no kernel in between
        end = max(end, e["ts"] + dur)
    total, span = sum(by_name.values()), end - events[0]["ts"]
    lines = [f"{len(events)} kernels: {total / per / 1e3:.3f} ms of kernels per {unit}, GPU span "
             f"{span / per / 1e3:.3f} ms, idle between kernels {idle / per / 1e3:.3f} ms (rank 0)"]
    lines += [f"{v / per / 1e3:10.3f} ms  {k}" for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]
    return lines


def runtime_table(path: str, per: int = 1, unit: str = "run", top: int = 8) -> list[str]:
    """Lines: the host's CUDA runtime and driver calls by total time, divided by `per`: a
    synchronizing call (cudaStreamSynchronize, cudaEventSynchronize, a pageable cudaMemcpy) that
    dominates says the host waited for the device there."""
    with open(path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    by_name: dict[str, tuple[float, int]] = {}
    for e in events:
        total, n = by_name.get(e["name"], (0.0, 0))
        by_name[e["name"]] = (total + e.get("dur", 0.0), n + 1)
    lines = [f"host CUDA calls per {unit} (rank 0):"]
    lines += [f"{v / per / 1e3:10.3f} ms  {n / per:8.1f} calls  {k}"
              for k, (v, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    return lines
