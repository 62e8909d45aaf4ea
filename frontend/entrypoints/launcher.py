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
import re
import socket
import sys
import time
from multiprocessing.connection import wait

import zmq

from ipc import envs
from ipc.config import ConfigError, check_tokenizer_files
from frontend.engine_client import local_address_towards
from engine_core.core import check_handshake_security
from frontend.entrypoints.dp_coordinator import DPCoordinator
from frontend.entrypoints.args import engine_config_from_args
from frontend.entrypoints.dp_layout import DPLayout
from frontend.entrypoints.model_download import resolve_hub_model
from ipc.procs import catch_stop_signals, coordinate_stops_here, request_drain, start_process, stop_processes
from shm.object_store import run_id
from ipc.sockets import ipc_address, make_ipc_dir, remove_ipc_dir
from metrics.multiproc import make_multiproc_dir, remove_multiproc_dir
from workers.models.registry import check_architecture, multimodal_info

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


def raise_open_file_limit(target: int = 65536) -> None:
    """The soft limit on open descriptors up to `target` (within the hard limit), as vLLM does:
    the usual 1,024 lets a client holding about a thousand idle connections lock everyone
    else out of an API server."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)


def serve(args: argparse.Namespace) -> int:
    """`loom serve`: check, start, supervise until a stop signal or a child's death, stop all."""
    logging.basicConfig(level=envs.LOOM_LOG_LEVEL,
                        format="%(asctime)s loom %(levelname)s %(message)s")
    try:
        config = resolve_hub_model(engine_config_from_args(args)).resolve(multimodal_info, check_architecture)
        auth_key = _check_args(args, config)
        run_id()  # exported: every child names its shm segments with this run's id
        raise_open_file_limit()   # inherited by every child: each HTTP connection is a descriptor
        coordinate_stops_here()   # a child's SIGTERM comes here (ipc/procs.py child_signals)
        if config.nnodes > 1 and config.node_rank > 0:  # a secondary node: only workers (TP over nodes)
            from engine_core.executor import serve_secondary_node
            return serve_secondary_node(config)
        dp = DPLayout.from_args(args, config, auth_key)
    except ConfigError as e:
        print(f"loom serve: {e}", file=sys.stderr)
        return 2
    launch = _Launch(args, config, dp, auth_key)
    stop = catch_stop_signals()   # before any child starts: a SIGTERM during start-up stops at once
    code = 2
    try:
        if not launch.start():
            return 2  # the reason is printed
        code = launch.supervise(stop)
    finally:
        launch.stop(clean=code == 0)
    logger.info("stopped (exit code %d)", code)
    return code


def _check_args(args: argparse.Namespace, config) -> str | None:
    """The engine auth key, once the flags that the config does not check are checked
    (ConfigError); across nodes, the key is exported for the workers' sockets."""
    if args.api_server_count is not None and args.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.max_request_body_bytes < 1:
        raise ConfigError("--max-request-body-bytes must be at least 1")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if not args.headless:   # (an engine alone takes token ids)
        check_tokenizer_files(config.tokenizer_dir)
    if args.api_key is not None and not args.api_key:   # "" would match a request with no key at all
        raise ConfigError("--api-key must not be empty")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    if args.engine_address and not re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):\d{1,5}", args.engine_address):
        raise ConfigError(f"--engine-address must be tcp://HOST:PORT, got {args.engine_address!r}")
    auth_key = args.engine_auth_key or envs.LOOM_ENGINE_AUTH_KEY
    if config.nnodes > 1:
        from engine_core.executor import check_network_security
        if auth_key:  # the workers' and the engine's sockets between nodes derive their CURVE keys from it
            os.environ["LOOM_ENGINE_AUTH_KEY"] = auth_key
        check_network_security(config.master_addr, auth_key)
        if config.node_rank > 0 and not args.headless:
            raise ConfigError("--node-rank > 0 runs only workers: add --headless")
    if args.headless and args.engine_address:
        check_handshake_security(args.engine_address, auth_key)
    return auth_key


class _Launch:
    """What one `loom serve` starts and owns: the HTTP socket, the engine cores (or, attached,
    an engine elsewhere), the API servers, the coordinator of remote data-parallel ranks, and
    the socket and metrics directories."""

    def __init__(self, args: argparse.Namespace, config, dp: DPLayout, auth_key: str | None):
        self.args, self.config, self.dp, self.auth_key = args, config, dp, auth_key
        self.attach = bool(args.engine_address) and not args.headless  # API servers of an engine elsewhere
        self.n_servers = args.api_server_count or config.data_parallel_size
        self.listen: socket.socket | None = None
        self.ipc_dir: str | None = None
        self.metrics_dir: str | None = None
        self.coordinator: DPCoordinator | None = None
        self.engines: list = []
        self.servers: list = []

    def start(self) -> bool:
        """Start everything; False (with the reason printed) when a socket cannot be bound."""
        args = self.args
        if not args.headless:
            self.listen = _listen(args.host, args.port)
            if self.listen is None:
                return False
        self.ipc_dir = None if self.attach else make_ipc_dir()
        clients = self._client_addresses()
        if self.dp.remote_ranks:  # the head: ranks of other nodes register on the rpc port
            try:
                self.coordinator = DPCoordinator(self.dp.head_rpc, self.dp.coordinator_lookup(self.ipc_dir),
                                                 self.dp.remote_ranks, self.auth_key)
            except zmq.ZMQError as e:
                print(f"loom serve: cannot listen on {self.dp.head_rpc}: {e}", file=sys.stderr)
                return False
            self.coordinator.start()
        if not self.attach:
            self.engines = self.dp.start_engine_cores(self.config, self.ipc_dir, clients,
                                                      args.engine_address if args.headless else None, self.auth_key)
        if self.listen is not None:
            self._start_api_servers(clients)
        return True

    def _client_addresses(self) -> list[tuple[str, str]]:
        """Each API server's (input, output) socket addresses towards the engine cores."""
        if self.attach:
            host = local_address_towards(self.args.engine_address)
            return [(f"tcp://{host}:*", f"tcp://{host}:*")] * self.n_servers
        return [(ipc_address(self.ipc_dir, f"client{i}-input"), ipc_address(self.ipc_dir, f"client{i}-output"))
                for i in range(0 if self.args.headless else self.n_servers)]

    def _start_api_servers(self, clients: list[tuple[str, str]]) -> None:
        from frontend.openai.api_server_proc import run_api_server_process
        args = self.args
        self.metrics_dir = make_multiproc_dir()  # before the API servers start: they inherit it (Prometheus multiprocess)
        server_opts = {"host": args.host, "port": args.port, "api_key": args.api_key,
                       "enable_control_endpoints": args.enable_control_endpoints,
                       "lora_modules": getattr(args, "lora_modules", None),
                       "engine_address": args.engine_address if self.attach else None,
                       "engine_auth_key": self.auth_key,
                       "enable_mfu_metrics": args.enable_mfu_metrics,
                       "max_request_body_bytes": args.max_request_body_bytes,
                       "trust_request_chat_template": args.trust_request_chat_template,
                       "chat_template_content_format": args.chat_template_content_format,
                       "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
                       "enable_tokenizer_info_endpoint": args.enable_tokenizer_info_endpoint,
                       "stream_interval": getattr(args, "stream_interval", 1),
                       "enable_orca_load_metrics": args.enable_orca_load_metrics,
                       "dp_lookup": self.dp.coordinator_lookup(self.ipc_dir) if self.coordinator else None,
                       "shutdown_timeout": args.shutdown_timeout}
        self.servers = [start_process(run_api_server_process, f"loom-api-server-{i}",
                                      (self.config.to_dict(), server_opts, i, clients[i][0], clients[i][1],
                                       self.listen))
                        for i in range(self.n_servers)]
        self.listen.close()  # the API servers hold it now
        self.listen = None

    def supervise(self, stop) -> int:
        """Wait for Ctrl-C / SIGTERM (0: the API servers drain first) or a child's death (1; 2 for a
        configuration mistake it found)."""
        engines, servers = self.engines, self.servers
        children = engines + servers
        while not stop.is_set():
            wait([p.sentinel for p in children], timeout=_POLL_S)
            dead = [p for p in children if not p.is_alive()]
            if dead and not stop.is_set():
                for p in dead:
                    logger.error("%s exited with code %s; shutting down", p.name, p.exitcode)
                if any(p in dead for p in engines):  # the API servers answer 503 meanwhile
                    wait([p.sentinel for p in servers], timeout=_DEAD_ENGINE_GRACE_S)
                # 2: a configuration mistake found in a child (a KV cache too small for --max-model-len)
                return 2 if any(p.exitcode == 2 for p in dead) else 1
        if servers:  # the API servers drain, then the engine stops
            logger.info("stopping: requests in flight get %.1fs", self.args.shutdown_timeout)
            for p in servers:
                request_drain(p)
            deadline = time.monotonic() + self.args.shutdown_timeout + 2
            while any(p.is_alive() for p in servers) and time.monotonic() < deadline:
                wait([p.sentinel for p in servers if p.is_alive()], timeout=_POLL_S)
        return 0

    def stop(self, clean: bool) -> None:
        """Stop every child (after a clean stop: the API servers first; else all at once, together)
        and remove what was made."""
        if clean:
            stop_processes(self.servers, timeout=5)
            stop_processes(self.engines, timeout=10)
        else:
            stop_processes(self.servers + self.engines, timeout=5)
        if self.coordinator is not None:
            self.coordinator.close()
        if self.listen is not None:
            self.listen.close()
        remove_ipc_dir(self.ipc_dir)
        remove_multiproc_dir(self.metrics_dir)
