"""`loom serve`: a thin parent that starts the engine core(s) (one per local data-parallel rank)
and N API servers, watches them, and takes everything down together.

Exit status: 0 after Ctrl-C / SIGTERM, non-zero when any child died (whatever the reason,
SIGTERM included); that is noticed within _POLL_S and everything is stopped at once.

On Ctrl-C / SIGTERM the API servers drain (ipc/procs.py request_drain): new requests get 503,
those in flight get --shutdown-timeout seconds, the rest end with an error. Then the engine stops.
If this process is SIGKILLed, its children see their death pipe close and exit, removing the
socket and metrics directories on the way (ipc/procs.py watch_parent).
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from multiprocessing.connection import wait

import zmq

from ipc.config import ConfigError
from engine_core.client import local_address_towards
from engine_core.core import check_handshake_security
from engine_core.dp_coordinator import DPCoordinator
from frontend.cli import engine_config_from_args
from frontend.dp_layout import DPLayout
from ipc.procs import catch_stop_signals, request_drain, start_process, stop_processes
from shm.object_store import run_id
from ipc.sockets import ipc_address, make_ipc_dir, remove_ipc_dir
from metrics.multiproc import make_multiproc_dir, remove_multiproc_dir

logger = logging.getLogger("loom")
_POLL_S = 0.1
# An engine died: its API servers answer 503 (/health included) for this long before they are
# stopped; short, as any child's death must end `loom serve` well within a second.
_DEAD_ENGINE_GRACE_S = 0.2


def _listen(host: str, port: int) -> socket.socket | None:
    """Bind the HTTP port here, so that a port in use fails at once and all API servers share it.

    Every API server accept()s on this one socket (no SO_REUSEPORT): all idle ones are woken and
    one wins, so new connections do spread over all of them (checked by
    tests/test_control_http.py: 200 fresh connections -> about 54/85/61 over 3 servers), and a busy
    server simply accepts less, where SO_REUSEPORT's hashing would still queue on it."""
    listen = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listen.bind((host, port))
    except OSError as e:
        print(f"loom serve: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        listen.close()
        return None
    listen.listen(1024)
    return listen


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=os.environ.get("LOOM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s loom %(levelname)s %(message)s")
    try:
        config = engine_config_from_args(args).resolve()
    except ConfigError as e:
        print(f"loom serve: {e}", file=sys.stderr)
        return 2
    run_id()  # exported: every child names its shm segments with this run's id
    n_servers = args.api_server_count or config.data_parallel_size
    if n_servers < 1:
        print("loom serve: --api-server-count must be at least 1", file=sys.stderr)
        return 2
    if args.max_request_body_bytes < 1:
        print("loom serve: --max-request-body-bytes must be at least 1", file=sys.stderr)
        return 2
    auth_key = args.engine_auth_key or os.environ.get("LOOM_ENGINE_AUTH_KEY")
    if config.nnodes > 1:
        if auth_key:  # the workers' and the engine's sockets between nodes derive their CURVE keys from it
            os.environ["LOOM_ENGINE_AUTH_KEY"] = auth_key
        from engine_core.executor import check_network_security, serve_secondary_node
        try:
            check_network_security(config.master_addr, auth_key)
        except ConfigError as e:
            print(f"loom serve: {e}", file=sys.stderr)
            return 2
        if config.node_rank > 0:  # a secondary node: only workers (tensor parallelism over nodes)
            if not args.headless:
                print("loom serve: --node-rank > 0 runs only workers: add --headless", file=sys.stderr)
                return 2
            return serve_secondary_node(config)
    attach = bool(args.engine_address) and not args.headless   # API servers of an engine elsewhere
    try:
        dp = DPLayout.from_args(args, config, auth_key)
        if args.headless and args.engine_address:
            check_handshake_security(args.engine_address, auth_key)
    except ConfigError as e:
        print(f"loom serve: {e}", file=sys.stderr)
        return 2

    servers, listen = [], None
    if not args.headless:
        listen = _listen(args.host, args.port)
        if listen is None:
            return 2
    ipc_dir = None if attach else make_ipc_dir()
    if attach:
        host = local_address_towards(args.engine_address)
        clients = [(f"tcp://{host}:*", f"tcp://{host}:*")] * n_servers
    else:
        clients = [(ipc_address(ipc_dir, f"client{i}-input"), ipc_address(ipc_dir, f"client{i}-output"))
                   for i in range(0 if args.headless else n_servers)]
    engines, coordinator = [], None
    if dp.remote_ranks:   # the head: ranks of other nodes register on the rpc port
        try:
            coordinator = DPCoordinator(dp.head_rpc, dp.coordinator_lookup(ipc_dir), dp.remote_ranks, auth_key)
        except zmq.ZMQError as e:
            print(f"loom serve: cannot listen on {dp.head_rpc}: {e}", file=sys.stderr)
            remove_ipc_dir(ipc_dir)
            if listen is not None:
                listen.close()
            return 2
        coordinator.start()
    if not attach:
        engines = dp.start_engine_cores(config, ipc_dir, clients, args.engine_address if args.headless else None,
                                        auth_key)
    metrics_dir = None
    if listen is not None:
        metrics_dir = make_multiproc_dir()  # before the API servers start: they inherit it (Prometheus multiprocess)
        server_opts = {"host": args.host, "port": args.port, "api_key": args.api_key,
                       "enable_control_endpoints": args.enable_control_endpoints,
                       "engine_address": args.engine_address if attach else None, "engine_auth_key": auth_key,
                       "enable_mfu_metrics": args.enable_mfu_metrics,
                       "max_request_body_bytes": args.max_request_body_bytes,
                       "trust_request_chat_template": args.trust_request_chat_template,
                       "chat_template_content_format": args.chat_template_content_format,
                       "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
                       "enable_tokenizer_info_endpoint": args.enable_tokenizer_info_endpoint,
                       "dp_lookup": dp.coordinator_lookup(ipc_dir) if coordinator is not None else None,
                       "shutdown_timeout": args.shutdown_timeout}
        from frontend.api_server_proc import run_api_server_process
        servers = [start_process(run_api_server_process, f"loom-api-server-{i}",
                                 (config.to_dict(), server_opts, i, clients[i][0], clients[i][1], listen))
                   for i in range(n_servers)]
        listen.close()  # the API servers hold it now
    children = engines + servers

    stop = catch_stop_signals()
    code = 0
    try:
        while not stop.is_set():
            wait([p.sentinel for p in children], timeout=_POLL_S)
            dead = [p for p in children if not p.is_alive()]
            if dead and not stop.is_set():
                for p in dead:
                    logger.error("%s exited with code %s; shutting down", p.name, p.exitcode)
                code = 1
                if any(p in dead for p in engines):
                    wait([p.sentinel for p in servers], timeout=_DEAD_ENGINE_GRACE_S)
                break
        if code == 0 and servers:   # Ctrl-C / SIGTERM: the API servers drain, then the engine stops
            logger.info("stopping: requests in flight get %.1fs", args.shutdown_timeout)
            for p in servers:
                request_drain(p)
            deadline = time.monotonic() + args.shutdown_timeout + 2
            while any(p.is_alive() for p in servers) and time.monotonic() < deadline:
                wait([p.sentinel for p in servers if p.is_alive()], timeout=_POLL_S)
    finally:
        if code == 0:
            stop_processes(servers, timeout=5)
            stop_processes(engines, timeout=10)
        else:   # a child died: stop the rest at once, together
            stop_processes(servers + engines, timeout=5)
        if coordinator is not None:
            coordinator.close()
        remove_ipc_dir(ipc_dir)
        remove_multiproc_dir(metrics_dir)
    logger.info("stopped (exit code %d)", code)
    return code
