"""`loom serve` to healthy, dummy weights: `python -m bench.startup [--presets ...] [--out DIR]`.

For each preset, three starts, each a new `loom serve` process:
- fresh: an empty cache directory (LOOM_CACHE_ROOT: Triton compiles every kernel, as on a fresh
  machine), the kernels compiled ahead in parallel (workers/compile_ahead.py, the default);
- second: the same directory again (a restart on a machine that has started the model once);
- fresh, LOOM_COMPILE_THREADS=0: another empty directory, each kernel compiled at its first launch
  (the A/B of the parallel compiles; --no-serial skips it).
Each start runs `loom serve --load-format dummy` at --log-level debug, polls /health until it
answers 200, and stops the server. Its log keeps the start-up breakdown: the `start-up of ...`
lines of the engine core and the workers, printed for every start, then one table (last) of
each start's seconds, target and the worker's phases; `other` is what no worker phase covers
(the launcher, the engine core's start and its spawn of the worker, the API server's first
health answer). Targets: issue 49. Results: DIR/startup.json (`fresh`, `second` per preset, read
by bench/targets.py, and the other rows).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

TARGETS = {"qwen3-0.6b": (12.0, 6.0), "llama-3.1-8b": (15.0, 9.0)}   # (fresh, second) seconds
# (column, prefix of the worker's phase name); "warm-up (N kernels compiled)" also gives N
COLUMNS = (("imports", "imports"), ("cuda", "CUDA init"), ("config", "config"), ("built", "model built"),
           ("filled", "weights filled"), ("state", "runner state"), ("profile", "profiling run"), ("kv", "KV cache"), ("warmup", "warm-up"),
           ("capture", "graph capture"))
_PHASE = re.compile(r"\s*([^,:;]+?) (\d+\.\d+) s")


def time_to_healthy(model_dir: str, cache_root: str, port: int, log_path: str, timeout: float,
                    env_extra: dict | None = None) -> float | None:
    """Seconds from launching `loom serve` to its first 200 on /health (None: it never answered)."""
    env = dict(os.environ, LOOM_CACHE_ROOT=cache_root, LOOM_LOG_LEVEL="DEBUG", PYTHONUNBUFFERED="1",
               **(env_extra or {}))
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
    """The log's `start-up of ...` lines, and the worker's lines on compiling kernels ahead and
    on capturing the graphs."""
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if "start-up of " in line:
                out.append(line.rstrip()[line.find("start-up of ") + len("start-up of "):])
            elif "kernels ahead" in line:
                out.append(line.rstrip()[line.find("compil"):])
            elif " decode graphs (batch" in line or "captured piecewise" in line:
                out.append(line.rstrip()[line.find("captured"):].split("; run in")[0])
    return out


def worker_phases(log_path: str) -> dict[str, float]:
    """Worker 0's phases by COLUMNS name (and `compiled`: the warm-up's kernels), its `all`."""
    try:
        with open(log_path, errors="replace") as f:
            line = next((x for x in f if "start-up of worker 0:" in x), "")
    except OSError:
        return {}
    body, _, total = line.split("start-up of worker 0:", 1)[-1].partition(";")
    out: dict[str, float] = {}
    for name, secs in _PHASE.findall(body):
        for col, prefix in COLUMNS:
            if name.startswith(prefix):
                out[col] = out.get(col, 0.0) + float(secs)
        m = re.match(r"warm-up \((\d+) kernels compiled\)", name)
        if m:
            out["compiled"] = float(m.group(1))
    m = re.search(r"(\d+\.\d+) s in all", total)
    if m:
        out["all"] = float(m.group(1))
    return out


def table(rows: list[tuple[str, str, float | None, float | None, dict]]) -> list[str]:
    """rows: (preset, start, seconds, target, worker phases) -> the table's lines."""
    head = (f"{'loom serve to healthy (dummy)':34s} {'s':>6s} {'target':>6s} {'pass':>4s} | "
            + " ".join(f"{c:>7s}" for c, _ in COLUMNS) + f" {'compiled':>8s} {'other':>6s}")
    out = [head, "-" * len(head)]
    for preset, start, took, target, ph in rows:
        verdict = "" if target is None else "PASS" if took is not None and took <= target else "FAIL"
        cells = " ".join(f"{ph[c]:7.2f}" if c in ph else f"{'-':>7s}" for c, _ in COLUMNS)
        other = f"{took - ph['all']:6.1f}" if took is not None and "all" in ph else f"{'-':>6s}"
        compiled = f"{int(ph['compiled']):8d}" if "compiled" in ph else f"{'-':>8s}"
        out.append(f"{preset + ' ' + start:34s} {'never' if took is None else f'{took:.1f}':>6s} "
                   f"{'' if target is None else f'{target:.0f}':>6s} {verdict:>4s} | {cells} {compiled} {other}")
    return out


def compile_bytecode(paths: list[str] | None = None) -> float:
    """Byte-compile every directory on the import path (or `paths`), as pip does at install; the
    seconds it took. An image that sets PYTHONDONTWRITEBYTECODE and ships packages without .pyc files
    otherwise has each process of each start compile its imports from source (~1,500 modules,
    3.4 s a process on the device image: bench/RESULTS.md, session 36), which an installed Loom
    does not pay."""
    import compileall
    t0 = time.perf_counter()
    for path in dict.fromkeys(p for p in (sys.path if paths is None else paths) if p and os.path.isdir(p)):
        if not compileall.compile_dir(path, quiet=2, workers=0):   # (a read-only directory stays as it is)
            print(f"  could not byte-compile all of {path}")
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(TARGETS))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/loom-bench"))
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds one start may take")
    p.add_argument("--budget", type=float, default=380.0,
                   help="seconds for every start together: a start that would pass it is cut or skipped")
    p.add_argument("--no-serial", action="store_true", help="skip the fresh start with LOOM_COMPILE_THREADS=0")
    p.add_argument("--compile-bytecode", action="store_true",
                   help="first byte-compile the import path (compile_bytecode: what pip's install does, where "
                        "the environment has no .pyc files and PYTHONDONTWRITEBYTECODE is set)")
    args = p.parse_args(argv)
    from bench.presets import write_preset

    if args.compile_bytecode:
        print(f"byte-compiled the import path in {compile_bytecode():.1f} s "
              f"(PYTHONDONTWRITEBYTECODE {'set' if sys.flags.dont_write_bytecode else 'unset'})")

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    results: dict = {}
    rows = []
    # the targets' starts of every preset first, the A/B starts after (what the budget cuts first)
    plan = [x for preset in args.presets for x in ((preset, "fresh", "parallel", {}),
                                                   (preset, "second", "parallel", {}))]
    if not args.no_serial:
        plan += [(preset, "fresh, LOOM_COMPILE_THREADS=0", "serial", {"LOOM_COMPILE_THREADS": "0"})
                 for preset in args.presets]
    with contextlib.ExitStack() as stack:
        tmp = lambda prefix: stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix))
        dirs = {}
        for preset in args.presets:
            dirs[preset] = {"model": tmp("loom-startup-model-"), "parallel": tmp("loom-startup-cache-"),
                            "serial": tmp("loom-startup-cache-")}
            write_preset(preset, dirs[preset]["model"])
        for preset, start, cache, env in plan:
            target = dict(zip(("fresh", "second"), TARGETS.get(preset, (None, None)))).get(start)
            key = start if cache == "parallel" else "fresh_serial"
            log_path = os.path.join(args.out, f"startup-{preset}-{key.replace('_', '-')}.log")
            left = args.budget - (time.perf_counter() - t0)
            if left < 20:
                print(f"== {preset} {start}: skipped (the --budget of {args.budget:.0f} s is spent)")
                continue
            took = time_to_healthy(dirs[preset]["model"], dirs[preset][cache], args.port, log_path,
                                   min(args.timeout, left), env)
            ph = worker_phases(log_path)
            results.setdefault(preset, {})[key] = took
            results[preset][f"{key}_phases"] = ph
            rows.append((preset, start, took, target, ph))
            print(f"== {preset} {start}: {'never healthy' if took is None else f'{took:.1f} s'} ({log_path})")
            for line in breakdown(log_path):
                print(f"   {line}")
            sys.stdout.flush()
    with open(os.path.join(args.out, "startup.json"), "w") as f:
        json.dump(results, f, indent=1)
    print()
    print("\n".join(table(rows)))
    return results


if __name__ == "__main__":
    main()
