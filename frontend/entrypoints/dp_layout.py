"""`loom serve`'s data-parallel layout: which engine cores (ranks) run on this node, and how
the ranks of other nodes join (frontend/entrypoints/dp_coordinator.py)."""
from __future__ import annotations

import argparse
import dataclasses
import os

from frontend.engine_client import local_address_towards
from engine_core.core import check_handshake_security, run_engine_core
from ipc.data_parallel import DPRank
from ipc.config import ConfigError, EngineConfig
from ipc.procs import start_process
from ipc.sockets import ipc_address


@dataclasses.dataclass
class DPLayout:
    size: int              # --data-parallel-size: engine cores in all
    local: int             # of which on this node
    start_rank: int        # the first rank on this node
    head_rpc: str | None   # tcp://address:port of the head's coordinator, when ranks live on other nodes
    headless: bool

    @property
    def local_ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.local)

    @property
    def remote_ranks(self) -> range:
        """On the head: the ranks that register from other nodes."""
        return range(self.local, self.size) if not self.headless else range(0)

    @classmethod
    def from_args(cls, args: argparse.Namespace, config: EngineConfig, auth_key: str | None) -> "DPLayout":
        size, start = config.data_parallel_size, args.data_parallel_start_rank
        dp_headless = args.headless and not args.engine_address
        if not args.headless and start != 0:
            raise ConfigError("--data-parallel-start-rank is for --headless nodes; the head runs ranks from 0")
        local = args.data_parallel_size_local
        if local is None:
            local = size - start
        if not (1 <= local and start >= 0 and start + local <= size):
            raise ConfigError(f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} "
                              f"does not fit in --data-parallel-size {size}")
        head_rpc = None
        if local < size:
            if args.engine_address:
                raise ConfigError("--engine-address attaches one engine; it cannot be combined with "
                                  "data-parallel ranks on other nodes")
            if args.data_parallel_rpc_port is None:
                raise ConfigError("ranks on other nodes (--data-parallel-size-local < --data-parallel-size) "
                                  "need --data-parallel-rpc-port")
            head_rpc = f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}"
            check_handshake_security(head_rpc, auth_key)
        if dp_headless and start == 0:
            raise ConfigError("--headless needs --engine-address tcp://HOST:PORT to listen on, or "
                              "--data-parallel-start-rank R >= 1 to join a head")
        if args.engine_address and size > 1:
            raise ConfigError("--engine-address attaches one engine core; --data-parallel-size must be 1")
        return cls(size, local, start, head_rpc, dp_headless)

    def start_engine_cores(self, config: EngineConfig, ipc_dir: str, clients: list[tuple[str, str]],
                           handshake_address: str | None, auth_key: str | None) -> list:
        """One process per local rank, each with its own workers, ring and GPUs."""
        if self.size == 1:
            return [start_process(run_engine_core, "loom-engine-core",
                                  (config.to_dict(), ipc_dir, clients, handshake_address, auth_key, None))]
        procs = []
        for local_rank, rank in enumerate(self.local_ranks):
            engine_dir = os.path.join(ipc_dir, f"dp{rank}")   # its workers' sockets and ring files
            os.mkdir(engine_dir, 0o700)
            handshake, register = None, None
            if self.headless:   # a remote rank: the head's API servers attach to it here
                handshake = f"tcp://{local_address_towards(self.head_rpc)}:*"
                register = self.head_rpc
            procs.append(start_process(run_engine_core, f"loom-engine-core-{rank}",
                                       (config.to_dict(), engine_dir, clients, handshake, auth_key,
                                        DPRank(rank, local_rank, register))))
        return procs

    def coordinator_lookup(self, ipc_dir: str) -> str:
        return ipc_address(ipc_dir, "dp-coordinator")
