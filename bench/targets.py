"""The speed targets (docs/performance.md, issue 49) in one table: `python -m bench.targets DIR`.

Reads the JSON results that `bench/gpu_suite.sh targets` (its parts targets-a and targets-b) wrote
into DIR and prints, per target, measured / target / PASS or FAIL (a target whose run is missing
or failed: "-", not run). Run before closing any issue that touches speed; the table goes into
bench/RESULTS.md.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, NamedTuple


class Target(NamedTuple):
    name: str
    file: str                               # the JSON result in DIR
    read: Callable[[dict, str], float]      # (that result, DIR) -> the measured value
    bound: float
    at_least: bool                          # True: measured >= bound; False: measured <= bound
    unit: str


def _sampling(mode: str) -> Callable[[dict, str], float]:
    return lambda r, _: r["sampling"][mode]["ratio"]


def _json(directory: str, name: str) -> dict:
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def _serve_ratio(r: dict, directory: str) -> float:
    return r["output_throughput"] / _json(directory, "targets-offline-c256.json")["output_tok_per_s"]


TARGETS = (
    Target("offline workload, Qwen3-0.6B", "targets-qwen3.json", lambda r, _: r["output_tok_per_s"], 25000, True,
           "tok/s"),
    Target("offline workload, Llama-3.1-8B", "targets-llama8b.json", lambda r, _: r["output_tok_per_s"], 10000, True,
           "tok/s"),
    Target("batch-1 per token, Llama-3.1-8B", "targets-latency-llama8b.json", lambda r, _: r["runs"][0]["tpot_ms"],
           4.2, False, "ms"),
    Target("batch-1 per token, Qwen3-0.6B", "targets-latency-qwen3.json", lambda r, _: r["runs"][0]["tpot_ms"],
           1.0, False, "ms"),
    Target("top-p 0.95, no top-k vs plain", "targets-qwen3.json", _sampling("topp-only"), 0.97, True, "x"),
    Target("top-p 0.9 + top-k 50 vs plain", "targets-qwen3.json", _sampling("topp"), 0.97, True, "x"),
    Target("top-p 0.95 + rep 1.1 + presence 0.5", "targets-qwen3.json", _sampling("topp-penalties"), 0.93, True,
           "x"),
    Target("logprobs=5 vs plain", "targets-qwen3.json", _sampling("logprobs"), 0.90, True, "x"),
    Target("n=4 seeded vs 4 separate", "targets-qwen3.json", _sampling("n4seed"), 1.0, True, "x"),
    Target("JSON-schema constrained vs free", "targets-structured.json",
           lambda r, _: r["structured_output"]["ratio"], 0.90, True, "x"),
    Target("256 x 512/256 vs HF generate", "targets-hf.json", lambda r, _: r["speedup_vs_hf"], 8.0, True, "x"),
    Target("serving c256 vs offline, same shape", "targets-serve-c256.json", _serve_ratio, 0.98, True, "x"),
    Target("loom serve to healthy, Qwen3-0.6B", "startup.json", lambda r, _: r["qwen3-0.6b"]["fresh"], 12.0, False,
           "s"),
    Target("  second start", "startup.json", lambda r, _: r["qwen3-0.6b"]["second"], 6.0, False, "s"),
    Target("loom serve to healthy, Llama-3.1-8B", "startup.json", lambda r, _: r["llama-3.1-8b"]["fresh"], 15.0,
           False, "s"),
    Target("  second start", "startup.json", lambda r, _: r["llama-3.1-8b"]["second"], 9.0, False, "s"),
)


def measure(directory: str) -> list[tuple[Target, float | None]]:
    rows = []
    for t in TARGETS:
        try:
            value = float(t.read(_json(directory, t.file), directory))
        except (OSError, ValueError, KeyError, TypeError, IndexError, ZeroDivisionError):
            value = None
        rows.append((t, value))
    return rows


def main(argv=None) -> int:
    directory = (argv or sys.argv[1:] or [os.environ.get("OUT", "/tmp/loom-bench")])[0]
    rows = measure(directory)
    print(f"{'target':40s} {'measured':>10s} {'target':>10s}  result")
    for t, value in rows:
        bound = f"{'>=' if t.at_least else '<='} {t.bound:g}"
        if value is None:
            print(f"{t.name:40s} {'-':>10s} {bound:>10s}  not run")
            continue
        ok = value >= t.bound if t.at_least else value <= t.bound
        shown = f"{value:.3f}" if t.unit == "x" or t.unit == "ms" else f"{value:,.1f}" if t.unit == "s" else f"{value:,.0f}"
        print(f"{t.name:40s} {shown:>10s} {bound:>10s}  {'PASS' if ok else 'FAIL'} ({t.unit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
