"""`loom serve` to healthy, dummy weights: `python -m bench.startup [--presets ...] [--out DIR]`.

For each preset: a start on an empty cache directory (LOOM_CACHE_ROOT: Triton compiles every
kernel, as on a fresh machine), then a second start on the same directory (a restart on a
machine that has started the model once). Each start runs `loom serve --load-format dummy` at
--log-level debug, polls /health until it answers 200, and stops the server; its log keeps the
start-up breakdown (the `start-up of ...` lines of the engine core and the workers), printed
after the table. Targets: issue 49.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

TARGETS = {"qwen3-0.6b": (12.0, 6.0), "llama-3.1-8b": (15.0, 9.0)}   # (fresh, second) seconds


def time_to_healthy(model_dir: str, cache_root: str, port: int, log_path: str, timeout: float) -> float | None:
    """Seconds from launching `loom serve` to its first 200 on /health (None: it never answered)."""
    env = dict(os.environ, LOOM_CACHE_ROOT=cache_root, LOOM_LOG_LEVEL="DEBUG", PYTHONUNBUFFERED="1")
    env.pop("TRITON_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", model_dir, "--load-format", "dummy",
           "--max-model-len", "4096", "--port", str(port)]
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        took = None
        try:
            while time.perf_counter() - t0 < timeout and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            took = time.perf_counter() - t0
                            break
                except OSError:
                    pass
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return took


def breakdown(log_path: str) -> list[str]:
    with open(log_path, errors="replace") as f:
        return [line.rstrip()[line.find("start-up of"):] for line in f if "start-up of" in line]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(TARGETS))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/loom-bench"))
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one start may take")
    args = p.parse_args(argv)
    from bench.presets import write_preset

    os.makedirs(args.out, exist_ok=True)
    results: dict = {}
    logs: list[tuple[str, str]] = []
    for preset in args.presets:
        with tempfile.TemporaryDirectory(prefix="loom-startup-model-") as model_dir, \
                tempfile.TemporaryDirectory(prefix="loom-startup-cache-") as cache_root:
            write_preset(preset, model_dir)
            for start in ("fresh", "second"):
                log_path = os.path.join(args.out, f"startup-{preset}-{start}.log")
                results.setdefault(preset, {})[start] = time_to_healthy(model_dir, cache_root, args.port, log_path,
                                                                         args.timeout)
                logs.append((f"{preset} {start}", log_path))
    print(f"{'loom serve to healthy (dummy)':32s} {'fresh s':>8s} {'target':>7s} {'second s':>9s} {'target':>7s}  pass")
    for preset, r in results.items():
        want = TARGETS.get(preset, (float("inf"), float("inf")))
        ok = all(r[k] is not None and r[k] <= t for k, t in zip(("fresh", "second"), want))
        fmt = lambda v: "never" if v is None else f"{v:.1f}"
        print(f"{preset:32s} {fmt(r['fresh']):>8s} {want[0]:>7.0f} {fmt(r['second']):>9s} {want[1]:>7.0f}  "
              f"{'PASS' if ok else 'FAIL'}")
    for name, path in logs:
        for line in breakdown(path):
            print(f"  {name}: {line}")
    with open(os.path.join(args.out, "startup.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
