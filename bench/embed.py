"""`loom bench embed`: an embeddings load generator against a running `loom serve --runner pooling`
(issue 48's target: Qwen3-Embedding-0.6B shape, 512-token inputs, /v1/embeddings at concurrency 64,
>= 250,000 prompt tokens/s on one H200).

Every input is --input-len random token ids (so its length is exact), one per request, sent as
OpenAI's token-id input with encoding_format base64 (what the openai SDK asks for); at most
--concurrency requests in flight, split over --processes client processes (one Python client
tops out near 1,000 requests/s). Prompt tokens/s counts the server's usage.prompt_tokens.

    loom bench preset qwen3-0.6b /tmp/q3
    loom serve /tmp/q3 --load-format dummy --runner pooling --port 8123 &
    loom bench embed --base-url http://127.0.0.1:8123 --input-len 512 --num-prompts 4096 --concurrency 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import time

import numpy as np

from bench.workloads import MAX_TOKEN_ID


def add_parser(sub) -> None:
    p = sub.add_parser("embed", help="embeddings load generator (/v1/embeddings)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.set_defaults(func=main)


def add_args(p) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    p.add_argument("--input-len", type=int, default=512, help="tokens per input")
    p.add_argument("--num-prompts", type=int, default=4096, help="requests to send (one input each)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--processes", type=int, default=4, help="client processes sharing the concurrency")
    p.add_argument("--encoding-format", default="base64", choices=("float", "base64"),
                   help="how the server returns each embedding")
    p.add_argument("--warmup", type=int, default=128, help="requests sent (and not timed) first")
    p.add_argument("--target", type=float, default=250_000.0, help="prompt tokens/s the table compares with")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--max-token-id", type=int, default=MAX_TOKEN_ID, help="random ids are below this")
    p.add_argument("--result-file", default=None, help="write the summary as JSON here")


async def _drive(url: str, model: str | None, inputs: list[list[int]], concurrency: int, fmt: str):
    import aiohttp
    latencies: list[float] = []
    tokens = errors = 0
    queue = iter(inputs)
    first_error = None

    async def worker(session) -> None:
        nonlocal tokens, errors, first_error
        for ids in queue:
            payload = {"input": ids, "encoding_format": fmt}
            if model:
                payload["model"] = model
            t0 = time.perf_counter()
            async with session.post(url, json=payload) as resp:
                body = await resp.read()
            if resp.status != 200:
                errors += 1
                first_error = first_error or body[:300].decode(errors="replace")
                continue
            latencies.append(time.perf_counter() - t0)
            tokens += json.loads(body)["usage"]["prompt_tokens"]

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return latencies, tokens, errors, first_error


def _client(args: tuple):
    url, model, inputs, concurrency, fmt, barrier = args
    barrier.wait()   # every process starts together: the window is theirs alone
    start = time.time()
    lat, tokens, errors, first_error = asyncio.run(_drive(url, model, inputs, concurrency, fmt))
    return start, time.time(), lat, tokens, errors, first_error


def run(args: argparse.Namespace) -> dict:
    import requests
    base = args.base_url.rstrip("/")
    url = base + "/v1/embeddings"
    model = args.model or requests.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(args.seed)
    make = lambda n: [[rng.randrange(args.max_token_id) for _ in range(args.input_len)] for _ in range(n)]  # noqa: E731
    if args.warmup:
        asyncio.run(_drive(url, model, make(args.warmup), args.concurrency, args.encoding_format))
    inputs = make(args.num_prompts)
    n = max(1, min(args.processes, args.concurrency))
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        shares = [(url, model, inputs[i::n], args.concurrency // n + (i < args.concurrency % n),
                   args.encoding_format, barrier) for i in range(n)]
        with ctx.Pool(n) as pool:
            results = pool.map(_client, shares)
    start = min(r[0] for r in results)
    duration = max(r[1] for r in results) - start
    lat = np.array([x for r in results for x in r[2]]) * 1000
    tokens = sum(r[3] for r in results)
    errors = sum(r[4] for r in results)
    summary = {"input_len": args.input_len, "concurrency": args.concurrency, "requests": len(lat),
               "errors": errors, "first_error": next((r[5] for r in results if r[5]), None),
               "duration_s": duration, "prompt_tok_per_s": tokens / duration if duration else 0.0,
               "req_per_s": len(lat) / duration if duration else 0.0,
               "latency_ms_p50": float(np.percentile(lat, 50)) if len(lat) else None,
               "latency_ms_p99": float(np.percentile(lat, 99)) if len(lat) else None,
               "target_tok_per_s": args.target}
    return summary


def print_table(s: dict) -> None:
    ok = s["prompt_tok_per_s"] >= s["target_tok_per_s"] and not s["errors"]
    print(f"{'metric':<32}{'measured':>14}{'target':>14}")
    print(f"{'prompt tokens/s (/v1/embeddings)':<32}{s['prompt_tok_per_s']:>14,.0f}{s['target_tok_per_s']:>14,.0f}"
          f"  {'PASS' if ok else 'FAIL'}")
    print(f"{'requests/s':<32}{s['req_per_s']:>14,.1f}")
    for k in ("latency_ms_p50", "latency_ms_p99"):
        if s[k] is not None:
            print(f"{k:<32}{s[k]:>14,.1f}")
    print(f"{'requests (errors)':<32}{s['requests']:>10} ({s['errors']})  input {s['input_len']} tokens, "
          f"concurrency {s['concurrency']}, {s['duration_s']:.1f} s")
    if s["first_error"]:
        print("first error:", s["first_error"])


def main(args: argparse.Namespace) -> int:
    s = run(args)
    print_table(s)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(s, f, indent=1)
    return 0 if not s["errors"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
