"""The table of `bench/gpu_suite.sh vl` (issue 49 item 6): Qwen2.5-VL-7B shapes under random-mm at
c32, requests/s against 1.5x the 7.99 req/s measured on 2026-11-28 (the same workload: 200 requests
of ~2,240 prompt tokens, texts of 1,491; see gpu_suite.sh), and the GPU's idle time before
encoder steps (the worker's LOOM_STEP_STATS summary, "step stats encoder: {...}" in the server's
log) as a share of the benchmark's duration, against 5%.

    python3 -m bench.vl_targets --serve-json vl-serve.json --server-log vl-server.log
"""
from __future__ import annotations

import argparse
import ast
import json
import re

BASELINE_REQS_PER_S = 7.99
SPEEDUP_TARGET = 1.5
IDLE_SHARE_TARGET = 0.05


def step_stats(log_text: str) -> dict[str, dict]:
    """kind -> the summary dict of the last "step stats KIND: {...}" line of each kind (a worker's)."""
    out = {}
    for kind, body in re.findall(r"step stats (\w+): (\{.*\})\s*$", log_text, flags=re.M):
        try:
            out[kind] = ast.literal_eval(body)
        except (ValueError, SyntaxError):
            continue
    return out


def rows(serve: dict | None, stats: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    reqs = serve.get("request_throughput") if serve else None
    duration = serve.get("duration") if serve else None
    enc = stats.get("encoder")
    idle_s = enc["idle_ms_before"] * enc["steps"] / 1e3 if enc else None
    share = idle_s / duration if idle_s is not None and duration else None
    target = SPEEDUP_TARGET * BASELINE_REQS_PER_S

    def fmt(v, f):
        return "n/a" if v is None else f.format(v)
    out = [("random-mm c32: req/s", fmt(reqs, "{:.2f}"), f">= {target:.2f}",
            "n/a" if reqs is None else "pass" if reqs >= target else "FAIL"),
           ("  GPU idle before encoder steps (s)", fmt(idle_s, "{:.2f}"), "", ""),
           ("  ... share of the run", fmt(share, "{:.1%}"), f"< {IDLE_SHARE_TARGET:.0%}",
            "n/a" if share is None else "pass" if share < IDLE_SHARE_TARGET else "FAIL")]
    for kind in ("encoder", "eager"):
        if kind in stats:
            s = stats[kind]
            out.append((f"  {kind} steps: n / host ms / device ms / idle ms",
                         f"{s['steps']} / {s['host_ms_per_step']:.1f} / {s['device_ms_per_step']:.1f} / "
                         f"{s['idle_ms_before']:.1f}", "", ""))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve-json", required=True)
    p.add_argument("--server-log", required=True)
    a = p.parse_args()
    try:
        with open(a.serve_json) as f:
            serve = json.load(f)
    except (OSError, ValueError):
        serve = None
    try:
        with open(a.server_log, errors="replace") as f:
            stats = step_stats(f.read())
    except OSError:
        stats = {}
    print(f"{'vl (issue 49 item 6)':44s} {'measured':>22s} {'target':>8s}")
    for name, measured, target, verdict in rows(serve, stats):
        print(f"{name:44s} {measured:>22s} {target:>8s} {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
