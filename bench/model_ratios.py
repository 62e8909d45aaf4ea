"""Issue 44's speed rows from one device call's throughput JSONs: each model's output tok/s
against Llama-3.1-8B's scaled by the ratio of their parameter bytes (a decode-bound engine
moves weights: a model with more bytes should be proportionally slower, no more).

    python3 -m bench.model_ratios OUT_DIR   (reads OUT_DIR/tput-<preset>.json, written by
                                             bench/gpu_suite.sh's `models` section)"""
from __future__ import annotations

import json
import os
import sys

from bench.presets import PRESETS, num_params

BASE = "llama-3.1-8b"


def main(out_dir: str) -> int:
    def tps(preset: str) -> float | None:
        path = os.path.join(out_dir, f"tput-{preset}.json")
        return json.load(open(path))["output_tok_per_s"] if os.path.exists(path) else None

    base = tps(BASE)
    print("| preset | params (B) | output tok/s | Llama-3.1-8B scaled | ratio (target >= 0.90) |")
    print("|---|---|---|---|---|")
    for preset in (BASE, "mistral-7b", "gemma-2-9b"):
        got, params = tps(preset), num_params(PRESETS[preset])
        if got is None or base is None:
            print(f"| {preset} | {params / 1e9:.2f} | (no result) | | |")
            continue
        scaled = base * num_params(PRESETS[BASE]) / params
        print(f"| {preset} | {params / 1e9:.2f} | {got:,.0f} | {scaled:,.0f} | {got / scaled:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
