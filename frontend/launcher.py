"""`loom serve`: a thin parent that starts the engine core and N API servers,
watches them, and takes everything down together.

Exit status: 0 after Ctrl-C / SIGTERM, non-zero when any child died.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from multiprocessing.connection import wait

from engine_core.config import ConfigError
from engine_core.core import run_engine_core
from frontend.cli import engine_config_from_args
from ipc.procs import start_process, stop_processes
from ipc.sockets import ipc_address, make_ipc_dir, remove_ipc_dir

logger = logging.getLogger("loom")
_DEAD_ENGINE_GRACE_S = 1.5  # let API servers answer 503 / fail in-flight requests before they go


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=os.environ.get("LOOM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s loom %(levelname)s %(message)s")
    try:
        config = engine_config_from_args(args).resolve()
    except ConfigError as e:
        print(f"loom serve: {e}", file=sys.stderr)
        return 2
    n_servers = args.api_server_count
    if n_servers < 1:
        print("loom serve: --api-server-count must be at least 1", file=sys.stderr)
        return 2
    listen = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listen.bind((args.host, args.port))
    except OSError as e:
        print(f"loom serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    listen.listen(1024)
    ipc_dir = make_ipc_dir()
    clients = [(ipc_address(ipc_dir, f"client{i}-input"), ipc_address(ipc_dir, f"client{i}-output"))
               for i in range(n_servers)]
    server_opts = {"host": args.host, "port": args.port, "api_key": args.api_key,
                   "enable_control_endpoints": args.enable_control_endpoints}
    from frontend.api_server_proc import run_api_server_process
    servers = [start_process(run_api_server_process, f"loom-api-server-{i}",
                             (config.to_dict(), server_opts, i, clients[i][0], clients[i][1], listen))
               for i in range(n_servers)]
    listen.close()  # the API servers hold it now
    engine = start_process(run_engine_core, "loom-engine-core", (config.to_dict(), ipc_dir, clients))
    children = [engine, *servers]

    stopping = False

    def _on_signal(signum, frame):
        nonlocal stopping
        stopping = True
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    code = 0
    try:
        while not stopping:
            wait([p.sentinel for p in children], timeout=0.2)
            dead = [p for p in children if not p.is_alive()]
            if dead and not stopping:
                for p in dead:
                    logger.error("%s exited with code %s; shutting down", p.name, p.exitcode)
                code = 1
                if engine in dead:
                    wait([p.sentinel for p in servers], timeout=_DEAD_ENGINE_GRACE_S)
                break
    finally:
        stop_processes(servers, timeout=5)
        stop_processes([engine], timeout=10)
        remove_ipc_dir(ipc_dir)
    logger.info("stopped (exit code %d)", code)
    return code
