"""The table of `bench/gpu_suite.sh serve-400` (issue 49 item 7): one API server at c512, 256 in /
128 out (req/s, output tok/s, the API server's CPU per request), and serving at c256 against offline
at the same shape (512 x 512/256), measured vs target.

    python3 -m bench.serve_targets --c512 serve400.json --c256 serve256.json --offline offline.json
"""
from __future__ import annotations

import argparse
import json

REQS_PER_S_TARGET = 400.0
SERVING_VS_OFFLINE_TARGET = 0.98


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rows(c512: dict | None, c256: dict | None, offline: dict | None, c512_interval: dict | None = None
         ) -> list[tuple[str, str, str, str]]:
    """(workload, measured, target, pass/fail); a run that left no result: 'n/a', fail."""
    def row(name, value, target, ok, fmt):
        return (name, "n/a" if value is None else fmt.format(value), target,
                "n/a" if value is None else ("pass" if ok else "FAIL"))
    reqs = c512 and c512.get("request_throughput")
    cpu = c512 and c512.get("api_server_cpu_per_request_ms")
    ratio = (c256["output_throughput"] / offline["output_tok_per_s"]
             if c256 and offline and offline.get("output_tok_per_s") else None)
    extra = []
    if c512_interval is not None:   # the same load with --stream-interval 4 (one chunk per 4 tokens)
        r = c512_interval.get("request_throughput")
        extra = [row("  with --stream-interval 4: req/s", r, "", True, "{:.1f}"),
                 row("  ... API server CPU per request (ms)", c512_interval.get("api_server_cpu_per_request_ms"),
                     "", True, "{:.2f}")]
    return [row("one API server, c512 256/128: req/s", reqs, f">= {REQS_PER_S_TARGET:.0f}",
                reqs is not None and reqs >= REQS_PER_S_TARGET, "{:.1f}"),
            row("  output tok/s", c512 and c512.get("output_throughput"), "", True, "{:.0f}"),
            row("  API server CPU per request (ms)", cpu, "(reported)", True, "{:.2f}"),
            *extra,
            row("serving c256 512/256: output tok/s", c256 and c256.get("output_throughput"), "", True, "{:.0f}"),
            row("offline 512/256: output tok/s", offline and offline.get("output_tok_per_s"), "", True, "{:.0f}"),
            row("serving c256 / offline", ratio, f">= {SERVING_VS_OFFLINE_TARGET:.0%}",
                ratio is not None and ratio >= SERVING_VS_OFFLINE_TARGET, "{:.1%}")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--c512", required=True)
    p.add_argument("--c256", required=True)
    p.add_argument("--offline", required=True)
    p.add_argument("--c512-interval", default=None, help="the c512 run against --stream-interval 4 (optional)")
    a = p.parse_args()
    table = rows(_load(a.c512), _load(a.c256), _load(a.offline),
                 _load(a.c512_interval) if a.c512_interval else None)
    print(f"{'serve-400 (issue 49)':40s} {'measured':>10s} {'target':>10s} {'':>5s}")
    for name, measured, target, verdict in table:
        print(f"{name:40s} {measured:>10s} {target:>10s} {verdict if target else '':>5s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
