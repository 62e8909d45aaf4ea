"""Issue 49 item 1 in one table: `python -m bench.top_p DIR` (after `bench/gpu_suite.sh top-p`).

Reads DIR/top-p.json (`loom bench throughput --sampling plain topp-only topp-penalties topp`: the
offline ratios to plain in one engine), DIR/top-p-eager-penalties.json (plain and topp-penalties with
LOOM_PENALTY_HEAD_GRAPHS=0: the penalty rows sampled eagerly, for A/B) and DIR/top-p-kernels.json (`bench.kernels_gpu --parts top_p`:
the sampler's device ms per call, graphed, with the top-p route's old and new variants) and prints
measured against target; a missing run shows "-".
"""
from __future__ import annotations

import json
import os
import sys

OFFLINE = (("top-p 0.95 alone vs plain", "topp-only", 0.97),
           ("top-p 0.95 + rep 1.1 + presence 0.5 vs plain", "topp-penalties", 0.93),
           ("top-p 0.9 + top-k 50 vs plain", "topp", 0.97))
KERNEL_MODES = ("top_p=0.95", "top_p=0.95 rep 1.1 pres 0.5", "top_p=0.9 top_k=50")


def _load(directory: str, name: str):
    try:
        with open(os.path.join(directory, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(argv=None) -> int:
    directory = (argv or sys.argv[1:] or [os.environ.get("OUT", "/tmp/loom-bench")])[0]
    offline, kernels = _load(directory, "top-p.json"), _load(directory, "top-p-kernels.json") or []
    print(f"\n{'issue 49 item 1':58s} {'measured':>9s} {'target':>8s}  result")
    eager = _load(directory, "top-p-eager-penalties.json")   # the same with LOOM_PENALTY_HEAD_GRAPHS=0 (A/B)
    rows = [(name, offline, mode, bound) for name, mode, bound in OFFLINE]
    rows.append(("  the same, penalties sampled eagerly (LOOM_PENALTY_HEAD_GRAPHS=0)", eager, "topp-penalties", 0.93))
    for name, result, mode, bound in rows:
        try:
            value = float(result["sampling"][mode]["ratio"])
        except (TypeError, KeyError, ValueError):
            print(f"{name:58s} {'-':>9s} {'>= ' + str(bound):>8s}  not run")
            continue
        print(f"{name:58s} {value:9.3f} {'>= ' + str(bound):>8s}  {'PASS' if value >= bound else 'FAIL'}")
    # the sampler's device time per call, graphed as the decode head runs it: new route / plain, and old
    for r in kernels:
        if r["mode"] in KERNEL_MODES and r["model"] == "qwen3-0.6b":
            plain = next((p["graph_new_ms"] for p in kernels if p["mode"] == "plain" and p["model"] == r["model"]
                          and p["batch"] == r["batch"] and p["logits"] == r["logits"]), float("nan"))
            name = f"sampler ms, B={r['batch']} {r['logits']} {r['mode']}, new route"
            print(f"{name:58s} {r['graph_new_ms']:9.4f} {'':>8s}  {r['graph_new_ms'] / plain:.2f}x plain "
                  f"({r['graph_old_ms']:.4f} old, plain {plain:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
