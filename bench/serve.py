"""`loom bench serve`: an HTTP load generator against a running server, in the
manner of `vllm bench serve`.

Random dataset with fixed lengths: every prompt is a list of --random-input-len
random token ids (so its length is exact) and asks for --random-output-len
tokens with ignore_eos. Requests go to /v1/completions, streamed with
stream_options.include_usage, at Poisson arrivals of --request-rate per second
(inf: all at once), at most --max-concurrency in flight.

Per request: TTFT (time to the first chunk carrying text), ITL (gaps between
successive chunks carrying text), TPOT ((E2E - TTFT) / (output tokens - 1)) and
E2E. Output tokens are the server's usage.completion_tokens. Against a server on this host, the
API-server processes' CPU seconds over the run and per request (bench/server_cpu.py).

    loom serve DIR --load-format dummy &
    loom bench serve --random-input-len 512 --random-output-len 256 --num-prompts 256 --max-concurrency 256
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime

import msgspec

from bench import asr, common, random_mm, server_cpu
from bench.workloads import MAX_TOKEN_ID, fixed_workload

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="online serving load generator (like `vllm bench serve`)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--endpoint", default="/v1/completions", help="the endpoint to send requests to")
    p.add_argument("--model", default=None, help="model name to send (None: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset-name", default="random", choices=["random", "random-mm", "asr"],
                   help="random: token-id prompts to /v1/completions; random-mm: random text and images "
                        "to /v1/chat/completions; asr: audio files to /v1/audio/transcriptions, RTFx reported "
                        "(default: %(default)s)")
    random_mm.add_args(p)
    asr.add_args(p)
    p.add_argument("--random-input-len", type=common.positive_int, default=1024, help="prompt tokens per request")
    p.add_argument("--random-output-len", type=common.positive_int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--num-prompts", type=common.positive_int, default=1000, help="requests to send")
    p.add_argument("--request-rate", type=common.positive_float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=common.positive_int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt ids stay below this (None: the model's config.json if the server's model "
                        "root is a local directory, else probed with /detokenize)")
    p.add_argument("--no-warmup", action="store_true", help="skip the one short test request")
    p.add_argument("--result-file", default=None, help="write all metrics and per-request data as JSON")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--num-processes", type=int, default=1,
                   help="load-generator processes that split the requests (round robin) and the concurrency; "
                        "one process parses ~50k streamed chunks/s at most, so use 4 above that. The metrics "
                        "are computed over every request together, as with one (default: %(default)s; "
                        "no progress bar with more than one)")
    p.set_defaults(func=main)


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    audio_seconds: float = 0.0   # asr: the clip's length

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


_decode_json = msgspec.json.Decoder().decode   # a chunk's JSON, ~2x faster than json.loads


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(session, url: str, payload: dict, headers: dict) -> RequestResult:
    """One streamed completion; timing of every chunk that carries text."""
    res = RequestResult(prompt_len=len(payload.get("prompt", ())),   # chat: from the usage
                        audio_seconds=payload.get("audio_seconds", 0.0))
    chunks = 0
    st = time.perf_counter()
    res.start = st
    last = st
    try:
        async with _post(session, url, payload, headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return res
            buf = b""
            done = False
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        body = line[5:].strip()
                        if body == b"[DONE]":
                            done = True
                            continue
                        obj = _decode_json(body)
                        if "error" in obj:
                            res.error = json.dumps(obj["error"])[:500]
                            return res
                        now = time.perf_counter()
                        choices = obj.get("choices") or []
                        if any(c.get("text") or c.get("delta", {}).get("content") for c in choices):
                            if chunks == 0:
                                res.ttft = now - st
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks += 1
                        usage = obj.get("usage")
                        if usage:
                            res.output_tokens = int(usage.get("completion_tokens") or 0)
                            res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
            res.e2el = time.perf_counter() - st
            if not done:
                res.error = "the stream ended without [DONE]"
                return res
    except Exception as e:  # noqa: BLE001
        res.error = f"{type(e).__name__}: {e}"
        return res
    if res.output_tokens == 0:
        res.output_tokens = chunks      # no usage chunk: one token per chunk
    if chunks == 0:
        res.error = "no output"
        return res
    res.success = True
    return res


def _post(session, url: str, payload: dict, headers: dict):
    """A JSON body, or (asr) a multipart form with the audio file."""
    if "form" not in payload:
        return session.post(url, json=payload, headers=headers)
    import aiohttp
    form = aiohttp.FormData()
    for k, v in payload["form"].items():
        form.add_field(k, v)
    name, data = payload["file"]
    form.add_field("file", data, filename=name, content_type="application/octet-stream")
    return session.post(url, data=form, headers=headers)


async def _get_json(session, url: str, headers: dict, payload: dict | None = None):
    method = session.post if payload is not None else session.get
    async with method(url, json=payload, headers=headers) as resp:
        return resp.status, (await resp.json(content_type=None) if resp.status < 500 else None)


async def detect_vocab(session, base_url: str, headers: dict, model_root: str | None) -> int:
    """Prompt ids must be < this: the model's vocab_size when the server's model directory is
    readable here, else the first id /detokenize rejects (binary search below 10001)."""
    if model_root and os.path.isfile(os.path.join(model_root, "config.json")):
        try:
            v = common.read_model_config(model_root).get("vocab_size")
            if v:
                return int(v)
        except (OSError, ValueError):
            pass
    url = base_url + "/detokenize"
    try:
        status, _ = await _get_json(session, url, headers, {"tokens": [MAX_TOKEN_ID]})
        if status == 200:
            return MAX_TOKEN_ID + 1
        if status == 404:
            return MAX_TOKEN_ID + 1
        lo, hi = 0, MAX_TOKEN_ID           # id lo is valid, id hi is not
        status, _ = await _get_json(session, url, headers, {"tokens": [0]})
        if status != 200:
            return MAX_TOKEN_ID + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            status, _ = await _get_json(session, url, headers, {"tokens": [mid]})
            lo, hi = (mid, hi) if status == 200 else (lo, mid)
        return hi
    except Exception:  # noqa: BLE001
        return MAX_TOKEN_ID + 1


def _stats(values: list[float]) -> dict:
    import numpy as np
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    a = np.asarray(values) * 1000.0
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    out = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    audio = sum(r.audio_seconds for r in ok)
    if audio:   # asr: seconds of audio transcribed per second (seed #32300)
        out["total_audio_seconds"] = audio
        out["rtfx"] = audio / duration if duration > 0 else 0.0
    for name in METRICS:
        s = _stats(series[name])
        for k, v in s.items():
            out[f"{k}_{name}_ms"] = v
    return out


def _peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.e2el, -1) for r in results if r.e2el > 0],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def print_report(m: dict, args) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Request rate configured (RPS):", f"{args.request_rate:.2f}"),
            ("Maximum request concurrency:", args.max_concurrency),
            ("Peak concurrent requests:", m["peak_concurrency"]),
            ("Benchmark duration (s):", f"{m['duration']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]),
            ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")]
    if "api_server_cpu_s" in m:   # the API servers' utime + stime over the run (bench/server_cpu.py)
        rows += [(f"API server CPU (s, {m['api_server_count']} proc):", f"{m['api_server_cpu_s']:.2f}"),
                 ("API server CPU per request (ms):", f"{m['api_server_cpu_per_request_ms']:.2f}")]
    if "rtfx" in m:
        rows += [("Total audio (s):", f"{m['total_audio_seconds']:.1f}"), ("RTFx (audio s / s):", f"{m['rtfx']:.2f}")]
    for k, v in rows:
        print(f"{k:<40} {v!s:<10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in METRICS:
        print("{s:{c}^{n}}".format(s=titles[name], n=w, c="-"))
        up = name.upper().replace("E2EL", "E2E")
        for key, label in [("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")]:
            print(f"{label + ' ' + up + ' (ms):':<40} {m[f'{key}_{name}_ms']:<10.2f}")
    print("=" * w)


async def run(args) -> dict:
    headers = _headers(args.api_key)
    base = args.base_url.rstrip("/")
    async with _session() as session:
        try:
            status, models = await _get_json(session, base + "/v1/models", headers)
        except (OSError, ValueError) as e:   # nothing listens there (aiohttp's errors are OSErrors), not a URL
            raise SystemExit(f"loom bench serve: cannot reach --base-url {args.base_url}: {type(e).__name__}: {e}")
        if status != 200 or not models or not models.get("data"):
            raise SystemExit(f"GET {base}/v1/models answered {status}: {models}")
        card = models["data"][0]
        model = args.model or card["id"]
        root = card.get("root") if not args.model or args.model == card["id"] else None
        vocab = args.vocab_size or await detect_vocab(session, base, headers, root)
        wl = fixed_workload(args.num_prompts, args.random_input_len, args.random_output_len, args.seed,
                            vocab_size=vocab)
        mm = args.dataset_name == "random-mm"
        is_asr = args.dataset_name == "asr"
        endpoint = "/v1/chat/completions" if mm and args.endpoint == "/v1/completions" else args.endpoint
        if is_asr and args.endpoint == "/v1/completions":
            endpoint = "/v1/audio/transcriptions"
        url = base + endpoint
        if mm:  # the random token ids as text of as many tokens (through the server's tokenizer), plus the images
            async def call(path: str, payload: dict) -> dict:
                status, answer = await _get_json(session, base + path, headers, {"model": model, **payload})
                if status != 200:
                    raise SystemExit(f"POST {base}{path} answered {status}: {answer}")
                return answer
            wl.prompts = random_mm.make_requests(args, await random_mm.texts_of_length(call, wl.prompts))
        if is_asr:
            wl.prompts = asr.clips(args, args.num_prompts)

        def payload(prompt, max_tokens: int) -> dict:
            if is_asr:
                return asr.payload(model, prompt, args.temperature, max_tokens)
            body = {"messages": prompt} if mm else {"prompt": prompt}
            return {"model": model, **body, "max_tokens": max_tokens, "temperature": args.temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        if not args.no_warmup:
            print("Sending one test request...", flush=True)
            test = await send_request(session, url, payload(wl.prompts[0], min(args.random_output_len, 4)),
                                      headers)
            if not test.success:
                raise SystemExit(f"the test request failed: {test.error}")

        print(f"Model {model}: {args.num_prompts} prompts, {args.random_input_len} in / "
              f"{args.random_output_len} out, request rate {args.request_rate}, "
              f"max concurrency {args.max_concurrency}", flush=True)
        load = Load(url, headers, [payload(p, m) for p, m in zip(wl.prompts, wl.max_tokens)],
                    arrival_offsets(args.num_prompts, args.request_rate, args.seed), args.max_concurrency)
        api_pids = server_cpu.api_server_pids(base)   # this host's API servers: their CPU per request
        cpu_before = server_cpu.cpu_seconds(api_pids)
        if args.num_processes == 1:
            start = time.perf_counter()
            results, end = await drive(session, load, start, show_progress=not args.disable_tqdm)
            duration = end - start
    if args.num_processes > 1:
        results, duration = run_processes(load, args.num_processes)

    m = summarize(results, duration)
    if api_pids:
        cpu = server_cpu.cpu_seconds(api_pids) - cpu_before
        m.update(api_server_count=len(api_pids), api_server_cpu_s=cpu,
                 api_server_cpu_per_request_ms=1000 * cpu / max(m["completed"], 1))
    m["peak_concurrency"] = _peak_concurrency([r for r in results if r.success])
    errors = [r.error for r in results if not r.success]
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "loom", "base_url": base,
        "endpoint": endpoint, "model_id": model, "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "seed": args.seed, "temperature": args.temperature,
        **m,
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "e2els": [r.e2el for r in results],
        "itls": [r.itl for r in results], "errors": errors,
    }


# ---------------------------------------------------------------- sending the requests

@dataclass
class Load:
    """The requests to send: each payload at start + its arrival offset, at most `concurrency` in flight."""
    url: str
    headers: dict
    payloads: list[dict]
    offsets: list[float]
    concurrency: int | None

    def share(self, k: int, n: int) -> "Load":
        """Process k's share of n: every n-th request and a share of the concurrency."""
        c = None if self.concurrency is None else self.concurrency // n + (k < self.concurrency % n)
        return Load(self.url, self.headers, self.payloads[k::n], self.offsets[k::n], c)


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: Poisson arrivals of `rate` per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(num):
        if i > 0 and rate != float("inf"):
            t += rng.expovariate(rate)
        out.append(t)
    return out


async def drive(session, load: Load, start: float, show_progress: bool = False) -> tuple[list[RequestResult], float]:
    """Send the load from `start` (perf_counter); the results in order, and when the last one ended."""
    bar = None
    if show_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(load.payloads), dynamic_ncols=True)
    sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def one(payload: dict) -> RequestResult:
        if sem is None:
            r = await send_request(session, load.url, payload, load.headers)
        else:
            async with sem:
                r = await send_request(session, load.url, payload, load.headers)
        if bar is not None:
            bar.update(1)
        return r

    tasks = []
    for payload, offset in zip(load.payloads, load.offsets):
        wait = start + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(payload)))
    results = await asyncio.gather(*tasks)
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    return list(results), end


def _session():
    import aiohttp
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=6 * 3600), trust_env=False,
                                 connector=aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60))


def _process_main(load: Load, conn) -> None:
    """A load-generator process: its session, then READY, then its share from the start time the parent
    sends; its results go back as msgpack. perf_counter is CLOCK_MONOTONIC on Linux, one clock for all."""
    async def main():
        async with _session() as session:
            conn.send_bytes(b"ready")
            start = msgspec.msgpack.decode(conn.recv_bytes())
            results, end = await drive(session, load, start)
        conn.send_bytes(msgspec.msgpack.encode((results, end)))
    _runner()(main())


def run_processes(load: Load, n: int) -> tuple[list[RequestResult], float]:
    """The load split over n processes; every request's result, in the order of the load, and the duration."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    try:
        for k in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_process_main, args=(load.share(k, n), child), name=f"bench-serve-{k}",
                               daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        for conn in pipes:
            conn.recv_bytes()                      # every process is up before the clock starts
        start = time.perf_counter() + 0.05
        for conn in pipes:
            conn.send_bytes(msgspec.msgpack.encode(start))
        shares = [msgspec.msgpack.decode(conn.recv_bytes(), type=tuple[list[RequestResult], float]) for conn in pipes]
    except EOFError:
        raise SystemExit("a load-generator process died (see its error above)") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return interleave([share for share, _ in shares]), max(end for _, end in shares) - start


def interleave(shares: list[list]) -> list:
    """The inverse of Load.share: item i of the whole from share i % n."""
    n = len(shares)
    out = [None] * sum(len(s) for s in shares)
    for k, share in enumerate(shares):
        out[k::n] = share
    return out


def _runner():
    try:
        import uvloop
        return uvloop.run
    except ImportError:
        return asyncio.run


def main(args: argparse.Namespace) -> int:
    if args.num_processes < 1 or (args.max_concurrency and args.num_processes > args.max_concurrency):
        raise SystemExit("--num-processes must be at least 1 and at most --max-concurrency")
    result = _runner()(run(args))
    print_report(result, args)
    if result["errors"]:
        print(f"first error: {result['errors'][0]}")
    common.write_json(args.result_file, result)
    return 0 if result["failed"] == 0 else 1
