"""RayExecutor: `--distributed-executor-backend ray`, the workers as Ray actors.

Only where the workers run changes: each rank is an actor on one bundle of a placement group
(`{"GPU": 1}` per rank on GPU machines, `{"CPU": 1}` on CPU; STRICT_PACK when the ranks fit one
node, else PACK), and the actor runs the same worker main as a `mp` worker process
(workers/worker.py run_worker). The step broadcast and the replies are MultiprocExecutor's:
the ranks on the engine core's node read the shared-memory ring and reply over IPC; the ranks
of other nodes read its TCP XPUB and reply over TCP (CURVE with --engine-auth-key), like a
`--headless` node's. torch.distributed meets at the engine core's node.

Liveness: a thread waits (ray.wait) on every actor's `run` call, which returns only when the
worker exits; one returning early (the actor died, was killed, or its node went) makes the
executor's death pipe readable, the same fatal path as a dead worker process. The actors share
the engine core's fate (Ray ends a driver's actors when it exits), and a Ray cluster started
here (no RAY_ADDRESS) goes with it.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading

from engine_core.executor import MultiprocExecutor, Nodes, check_network_security
from ipc import envs
from ipc.config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)
_RAY_NAMESPACE = "loom"
# what the actors inherit from the engine core's environment (Ray's workers start from the raylet's)
_ENV_PREFIXES = ("LOOM_", "TRITON_", "CUDA_DEVICE_ORDER", "NCCL_", "GLOO_", "TORCH_", "HF_", "OMP_")


class _WorkerActor:
    """One rank: a Ray actor whose `run` is the worker's whole life (workers/worker.py run_worker)."""

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def run(self, rank: int, local_rank: int, config_dict: dict, ring_handle, reply_address: str,
            rendezvous) -> None:
        from workers.worker import run_worker
        run_worker(rank, local_rank, config_dict, ring_handle, reply_address, rendezvous, None)


class RayNodes(Nodes):
    """Nodes, as the placement group placed the ranks: the engine core's node runs ranks
    [0, local), the other nodes the rest; they meet at the engine core's node IP."""

    def __init__(self, config: EngineConfig, local: int, count: int, node_ip: str):
        self.count, self.local, self.world = count, local, config.tensor_parallel_size
        self.node_rank = 0
        self.addr = node_ip if count > 1 else "127.0.0.1"
        self.port = config.master_port
        self.auth_key = envs.LOOM_ENGINE_AUTH_KEY or None
        if count > 1:
            check_network_security(self.addr, self.auth_key)


class RayExecutor(MultiprocExecutor):
    """MultiprocExecutor whose workers are Ray actors on a placement group."""

    def __init__(self, config: EngineConfig, ipc_dir: str, startup_timeout: float = 900.0):
        self._actors: list = []       # by rank
        self._runs: list = []         # each actor's `run` ObjectRef, by rank
        self._pg = None
        self._started_ray = False
        self._stopping = threading.Event()
        try:
            super().__init__(config, ipc_dir, startup_timeout)
        except BaseException:
            self._release()
            raise
        self._watch_actors()

    # ------------------------------------------------------------ placement

    def _place(self, config: EngineConfig) -> Nodes:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ConfigError("--distributed-executor-backend ray needs Ray: pip install 'loom[ray]'") from None
        if not ray.is_initialized():
            # RAY_ADDRESS (or a `ray start` cluster on this node) is joined; else a local one starts
            ray.init(namespace=_RAY_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False,
                     **({} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}))
            self._started_ray = True
        world = config.tensor_parallel_size
        gpu = _uses_gpu(config)
        bundle = {"GPU": 1} if gpu else {"CPU": 1}
        strategy = "STRICT_PACK" if _fits_one_node(ray, bundle, world) else "PACK"
        self._pg = placement_group([dict(bundle) for _ in range(world)], strategy=strategy)
        try:
            ray.get(self._pg.ready(), timeout=envs.LOOM_RAY_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"Ray could not place {world} bundles of {bundle} ({strategy}) within "
                              f"{envs.LOOM_RAY_PLACEMENT_TIMEOUT_S:.0f} s: the cluster lacks the resources "
                              f"(ray status)") from None
        here = ray.get_runtime_context().get_node_id()
        env = _actor_env()
        token = secrets.token_hex(4)
        actor_cls = ray.remote(_WorkerActor)
        actors = []
        for i in range(world):
            actors.append(actor_cls.options(
                name=f"loom-worker-{i}-{token}", namespace=_RAY_NAMESPACE,
                num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, max_restarts=0,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i)).remote())
        node_ids = ray.get([a.node_id.remote() for a in actors])
        # ranks: the engine core's node first (they read the shared-memory ring), then by node
        order = sorted(range(world), key=lambda i: (node_ids[i] != here, node_ids[i], i))
        self._actors = [actors[i] for i in order]
        self._nodes_of_rank = [node_ids[i] for i in order]
        local = sum(n == here for n in node_ids)
        if local == 0:
            raise ConfigError("no bundle of the placement group is on the engine core's node: run `loom serve` "
                              "on a node of the Ray cluster that has GPUs (the head)")
        count = len(set(node_ids))
        node_ip = ray.util.get_node_ip_address()
        logger.info("Ray placement group (%s): %d ranks on %d node(s), %d on this one", strategy, world,
                    count, local)
        return RayNodes(config, local, count, node_ip)

    def _start_worker(self, run_worker, rank: int, config: EngineConfig, ring_handle, reply_address: str) -> None:
        self._runs.append(self._actors[rank].run.remote(rank, self._local_rank(rank), config.to_dict(),
                                                        ring_handle, reply_address, self.rendezvous))

    def _start_remote_workers(self, run_worker, config: EngineConfig, nodes: Nodes) -> None:
        for rank in range(nodes.local, nodes.world):
            self._runs.append(self._actors[rank].run.remote(rank, self._local_rank(rank), config.to_dict(),
                                                            nodes.remote_handle(), nodes.reply_address,
                                                            self.rendezvous))

    def _local_rank(self, rank: int) -> int:
        """The rank's index among its node's ranks (on GPU, Ray shows each actor its one GPU: 0)."""
        if _uses_gpu_env():
            return 0
        node = self._nodes_of_rank[rank]
        return self._nodes_of_rank[:rank].count(node)

    # ------------------------------------------------------------ liveness

    def _watch_actors(self) -> None:
        """An actor's `run` returns only when its worker ends: before shutdown, that is a death."""
        import ray

        def watch():
            try:
                done, _ = ray.wait(list(self._runs), num_returns=1, timeout=None)
            except Exception as e:   # Ray itself went away (its cluster stopped)
                reason = f"the Ray cluster went away ({type(e).__name__})"
            else:
                rank = self._runs.index(done[0])
                try:
                    ray.get(done[0])
                    reason = f"Ray worker actor of rank {rank} exited"
                except Exception as e:
                    reason = f"Ray worker actor of rank {rank} died ({type(e).__name__})"
            if self._stopping.is_set():
                return
            self._remote_dead = reason
            try:
                os.write(self._dead_w, b"x")
            except OSError:
                pass
        threading.Thread(target=watch, name="ray-actor-watch", daemon=True).start()

    def dead_worker(self) -> str | None:
        return self._remote_dead

    # ------------------------------------------------------------ teardown

    def shutdown(self) -> None:
        import ray
        from ipc.messages import MsgType, WorkerCall
        self._stopping.set()
        try:
            if self._remote_dead is None:
                self.ring.enqueue(self.enc.encode(MsgType.WORKER_CALL.value, WorkerCall("shutdown")), timeout=1)
                ray.wait(list(self._runs), num_returns=len(self._runs), timeout=5)
        except Exception:
            pass
        self._release()
        self.ring.close()
        self.close_sockets()

    def _release(self) -> None:
        """Kill the actors, remove the placement group, and stop a Ray cluster started here."""
        self._stopping.set()
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self._pg)
            except Exception:
                pass
        self._actors, self._pg = [], None
        ray.shutdown()   # disconnects; a cluster that ray.init started here stops with it


def _uses_gpu(config: EngineConfig) -> bool:
    if config.device == "cpu":
        return False
    if config.device == "cuda":
        return True
    return _uses_gpu_env()


def _uses_gpu_env() -> bool:
    import torch
    return torch.cuda.is_available()


def _fits_one_node(ray, bundle: dict, world: int) -> bool:
    """STRICT_PACK when some node alone has the resources for every rank."""
    (key, per), = bundle.items()
    for node in ray.nodes():
        if node.get("Alive") and node.get("Resources", {}).get(key, 0) >= per * world:
            return True
    return False


def _actor_env() -> dict[str, str]:
    """The engine core's settings the workers read, and where our packages are."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return env
