"""The `loom` command: serve, demo-model, bench."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from frontend.entrypoints.args import LoomParser, add_engine_args
from ipc.config import ConfigError


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (see README.md).")
    p.add_argument("model", help="a Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="API-server processes sharing the port (None: --data-parallel-size)")
    p.add_argument("--enable-control-endpoints", action="store_true",
                   help="serve /sleep, /wake_up, /pause, /resume, /reset_prefix_cache, /collective_rpc")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters (PEFT directories) served from the start, each "
                        "name=path or a JSON object {\"name\", \"path\", \"base_model_name\"}; a request "
                        "picks one by its name as `model`")
    p.add_argument("--headless", action="store_true",
                   help="run only the engine core(s) and workers: with --engine-address, one engine that "
                        "clients attach to; with --data-parallel-start-rank, data-parallel ranks that join a head")
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="engine cores (data-parallel ranks) on this node (None: all of them on the head, "
                        "the rest from --data-parallel-start-rank when --headless)")
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="the first data-parallel rank on this node (0 on the head)")
    p.add_argument("--data-parallel-address", "-dpa", default="127.0.0.1",
                   help="the head's address: where it listens for remote ranks on --data-parallel-rpc-port, "
                        "and where --headless ranks find it")
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None,
                   help="the head's port where engine cores of other nodes register (needed when "
                        "--data-parallel-size-local < --data-parallel-size)")
    p.add_argument("--engine-address", default=None,
                   help="tcp://HOST:PORT of an engine core's handshake socket: with --headless, where it "
                        "listens; without, the engine these API servers attach to")
    p.add_argument("--engine-auth-key", default=None,
                   help="shared secret of the engine protocol over TCP (CURVE keys are derived from it; "
                        "required off loopback; also LOOM_ENGINE_AUTH_KEY)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds requests in flight get to finish after SIGTERM / Ctrl-C before they end "
                        "with an error")
    p.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest HTTP request body accepted; a larger one gets a 413 (default: %(default)s = 8 MiB)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="allow requests to supply their own chat template (chat_template, or "
                        "chat_template_kwargs.chat_template); refused with a 400 otherwise. A template is "
                        "code its caller wrote: it renders in the killable tokenizer process, for at most "
                        "LOOM_CHAT_TEMPLATE_TIMEOUT_S (5 s) per request, and holds the large-input lane "
                        "meanwhile; enable it only for callers you trust")
    p.add_argument("--chat-template-content-format", default="auto", choices=("auto", "string", "openai"),
                   help="how message content parts reach the chat template: joined into one string, or as "
                        "OpenAI's list of parts; auto: detected from the template (default: %(default)s)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details.cached_tokens (prefix-cache hits) to every response")
    p.add_argument("--stream-interval", type=_at_least_one, default=1,
                   help="tokens a stream gathers before a chunk goes out (the first token and the last go "
                        "at once): a larger value sends fewer, larger chunks and cuts the API server's CPU per "
                        "token (vLLM's; default: %(default)s, every token)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's configuration, chat template included)")
    p.add_argument("--enable-orca-load-metrics", action="store_true",
                   help="add ORCA's endpoint-load-metrics header (TEXT; kv_cache_usage_perc, num_requests_waiting, "
                        "num_requests_running) to every generation response; without it only to requests that "
                        "send endpoint-load-metrics-format: text|json")
    p.add_argument("--log-level", type=str.lower, default=None, choices=("debug", "info", "warning", "error"),
                   help="log level of every process of the server (None: $LOOM_LOG_LEVEL, else info)")
    p.add_argument("--enable-mfu-metrics", action="store_true",
                   help="export estimated FLOPs and memory traffic (vllm:estimated_*_per_gpu_total; "
                        "metrics/mfu.py)")
    add_engine_args(p)


def _exit_now(code: int) -> None:
    """`loom serve` has stopped its children and removed its directories: skip the interpreter's
    teardown (0.2-0.3 s on 2 cores), so that a dying child ends `loom serve` within a second."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = LoomParser(prog="loom", description="Loom LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo = sub.add_parser("demo-model", help="build the tiny embedded demo model (Qwen3 architecture)")
    demo.add_argument("dir", help="directory to write the model (config.json, safetensors, tokenizer) to")
    demo.add_argument("--steps", type=int, default=None,
                      help="optimizer steps; None: the builder's DEFAULT_STEPS (200, frontend/tools/demo_model.py; "
                           "700 with --vision, frontend/tools/demo_vision_model.py)")
    demo.add_argument("--seed", type=int, default=0, help="training seed")
    demo.add_argument("--vision", action="store_true",
                      help="build the vision demo instead: a tiny Qwen2.5-VL trained on generated pictures of "
                           "coloured shapes, that names the colour and shape (2-3 min on 2 CPU cores)")
    try:
        from bench.cli import add_bench_parser
        add_bench_parser(sub)
    except ImportError:
        pass
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            if args.log_level:   # exported: the engine core, workers and API servers inherit it
                os.environ["LOOM_LOG_LEVEL"] = args.log_level.upper()
            from frontend.entrypoints.launcher import serve
            _exit_now(serve(args))
        if args.command == "demo-model":
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
            if args.vision:
                from frontend.tools.demo_vision_model import build_demo_vision_model
                build_demo_vision_model(args.dir, steps=args.steps, seed=args.seed)
            else:
                from frontend.tools.demo_model import build_demo_model
                build_demo_model(args.dir, steps=args.steps, seed=args.seed)
            return 0
        if args.command == "bench":
            return args.func(args)
    except ConfigError as e:   # a configuration that can never work: one line, no traceback
        print(f"loom {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C before `loom serve` took over the signal (while it loads)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # (a second one must not cut the exit short)
        print(f"loom {args.command}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
