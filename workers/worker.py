"""The worker process: reads each step from the broadcast ring, runs it, replies.

Only rank 0 returns sampled tokens; every rank reports errors.
"""
from __future__ import annotations

import logging
import os
import traceback

import zmq

from ipc import envs
from ipc.config import EngineConfig
from ipc.messages import GrammarOutput, MsgType, SchedulerOutput, WorkerCall, WorkerReply
from ipc.procs import child_signals, freeze_startup_heap, watch_parent
from ipc.profiling import maybe_profile
from ipc.serial import Decoder, Encoder
from ipc.sockets import make_socket
from ipc.worker_methods import remote
from workers.step_pipeline import StepPipeline

logger = logging.getLogger(__name__)


def cpu_threads(num_workers: int = 1) -> int:
    """Intra-op threads for a worker computing on the CPU: the cores this process may use, less
    one for the API server and engine core, which must run between steps, shared among the
    workers (OMP_NUM_THREADS, when set, decides). Torch's default, one thread per core, has
    OpenMP threads spin-waiting on cores those processes need: measured 10-14x slower serving
    on a 2-core box."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (len(os.sched_getaffinity(0)) - 1) // max(num_workers, 1))


class Worker:
    def __init__(self, config: EngineConfig, rank: int, local_rank: int | None = None, rendezvous=None):
        """rank: in the tensor-parallel group; local_rank: which GPU of this node (cuda:local_rank)."""
        from workers.model_runner import ModelRunner, resolve_device, resolve_dtype
        self.config = config
        self.rank = rank
        local_rank = rank if local_rank is None else local_rank
        if rendezvous is not None:
            from workers.distributed import init_distributed
            device = resolve_device(config, local_rank)
            if device.type == "cuda":
                import torch
                torch.cuda.set_device(device)
            init_distributed(rank, rendezvous, device, resolve_dtype(config, device),
                             expert_parallel=config.enable_expert_parallel)
        if resolve_device(config, local_rank).type == "cpu":
            import torch
            torch.set_num_threads(cpu_threads(config.tensor_parallel_size // max(config.nnodes, 1)))
            logger.info("CPU worker: %d torch threads", torch.get_num_threads())
        self.runner = ModelRunner(config, local_rank)
        self._weights = None    # WeightUpdater, made on the first weight-update call
        self._profiler = None   # WorkerProfiler, made on the first start_profile

    @property
    def weights(self):
        if self._weights is None:
            from workers.weight_update import WeightUpdater
            self._weights = WeightUpdater(self.runner, self.rank)
        return self._weights

    # @remote: what the engine core (collective_rpc) may call. ipc/worker_methods.py lists them
    # (engine-only or open to clients) for processes that do not import this module.

    @remote
    def ping(self) -> str:
        return "pong"

    @remote
    def device_type(self) -> str:
        return self.runner.device.type

    @remote
    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    @remote
    def kv_sliding_window(self) -> int | None:
        return self.runner.kv_sliding_window()

    @remote
    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_cache(num_blocks)

    @remote
    def kv_block_bytes(self) -> int:
        """One KV block's bytes on this rank, over all layers (the CPU tier's slot size)."""
        return self.runner.kv_spec.block_bytes()

    @remote
    def initialize_cpu_tier(self, num_slots: int) -> None:
        from workers.kv_offload import HostKVTier
        self.runner.cpu_tier = HostKVTier(num_slots, self.runner.kv_caches)

    @remote
    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    @remote
    def wake_up(self, tags: list[str], weights_dir: str | None = None, load_format: str | None = None) -> int:
        return self.runner.wake_up(tags, weights_dir, load_format)

    @remote
    def memory_info(self) -> dict:
        return self.runner.memory_info()

    @remote
    def step_stats(self) -> dict | None:
        """Host and device time per step, and Triton compiles after warm-up (LOOM_STEP_STATS=1)."""
        return self.runner.stats.summary() if self.runner.stats is not None else None

    @remote
    def all_reduce_info(self) -> dict:
        """This rank's place in the tensor-parallel group and its all-reduce paths."""
        from workers.distributed import describe
        return describe()

    @remote
    def get_pid(self) -> int:
        return os.getpid()

    # ---- weight updates (engine only: the engine core checks the pause state and resets the
    # prefix cache; workers/weight_update.py)

    @remote
    def update_weights_from_disk(self, model_path: str, load_format: str = "auto") -> int:
        return self.weights.update_from_disk(model_path, load_format)

    @remote
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        """Start joining a trainer's group (the engine then polls weights_update_group_ready)."""
        self.weights.init_group(master_address, master_port, rank_offset, world_size, group_name, backend)

    @remote
    def weights_update_group_ready(self, group_name: str) -> bool:
        return self.weights.group_ready(group_name)

    @remote
    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str) -> int:
        return self.weights.update_from_distributed(names, dtypes, shapes, group_name)

    @remote
    def destroy_weights_update_group(self, group_name: str) -> None:
        self.weights.destroy_group(group_name)

    @remote
    def update_weights_from_tensor(self, named_tensors: list) -> int:
        return self.weights.update_from_tensors(named_tensors)

    @remote
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict:
        return self.weights.get_weights_by_name(name, truncate_size)

    # ---- torch profiler (workers/profiler.py)

    @remote
    def start_profile(self, profile_prefix: str | None = None) -> str:
        if self._profiler is None:
            from workers.profiler import WorkerProfiler
            if not self.config.profiler_dir:
                raise ValueError("no profiler directory: start the server with --profiler-dir DIR "
                                 "(or LOOM_TORCH_PROFILER_DIR=DIR)")
            dp_rank = self.config.data_parallel_rank
            global_rank = dp_rank * self.config.tensor_parallel_size + self.rank
            self._profiler = WorkerProfiler(self.config.profiler_dir, self.runner.device, dp_rank, self.rank,
                                            global_rank)
        return self._profiler.start(profile_prefix)

    @remote
    def stop_profile(self) -> str:
        if self._profiler is None:
            raise ValueError("the profiler is not running: start it first")
        return self._profiler.stop()

    # ---- LoRA adapters (workers/lora/manager.py)

    def _loras(self):
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")
        return self.runner.lora

    @remote
    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str, load_inplace: bool = False) -> bool:
        from ipc.lora import LoRARequest
        return self._loras().add_lora(LoRARequest(lora_name, lora_int_id, lora_path), load_inplace)

    @remote
    def remove_lora(self, lora_int_id: int) -> bool:
        return self._loras().remove_lora(lora_int_id)

    @remote
    def list_loras(self) -> list[int]:
        return self._loras().list_loras()

    def call(self, call: WorkerCall):
        fn = getattr(self, call.method, None)
        if fn is None or not getattr(fn, "_loom_remote", False):
            raise ValueError(f"method {call.method!r} is not callable on workers")
        return fn(*call.args, **call.kwargs)


def serve_steps(worker: Worker, ring, send) -> None:
    """The worker loop: steps and samples in the order workers/step_pipeline.py keeps; a
    pending step's tokens are sent as soon as the device has them, unless the next step comes
    first (it is launched behind it, unwaited); calls between steps."""
    runner, rank = worker.runner, worker.rank
    step_dec, call_dec, sample_dec = Decoder(SchedulerOutput), Decoder(WorkerCall), Decoder(GrammarOutput)

    def emit(out) -> None:
        if rank == 0:
            send(WorkerReply(rank, output=out))

    steps = StepPipeline(runner, emit)
    while True:
        if steps.pending is not None and not ring.ready():
            if runner.is_done(steps.pending):
                steps.finish_pending()
            else:
                os.sched_yield()
            continue
        frames = ring.dequeue()
        kind = bytes(frames[0])
        if kind in (MsgType.WORKER_STEP.value, MsgType.WORKER_SAMPLE.value):
            try:
                if kind == MsgType.WORKER_SAMPLE.value:
                    steps.sample(sample_dec.decode(frames))
                else:
                    steps.step(step_dec.decode(frames))
            except Exception:
                send(WorkerReply(rank, error=traceback.format_exc()))
                raise
            continue
        if steps.pending is not None:
            steps.finish_pending()
        call = call_dec.decode(frames)
        if call.method == "shutdown":
            if runner.stats is not None:
                runner.stats.log()
            return
        try:
            send(WorkerReply(rank, result=worker.call(call), call_id=call.call_id))
        except Exception as e:  # a failed call is the caller's problem, not the worker's
            send(WorkerReply(rank, error=f"{type(e).__name__}: {e}", call_id=call.call_id))


def run_worker(rank: int, local_rank: int, config_dict: dict, ring_handle, reply_address: str, rendezvous,
               death_pipe) -> None:
    if death_pipe is not None:   # None: a Ray actor, whose life Ray ties to the engine's (RayExecutor)
        watch_parent(death_pipe)
        child_signals()
    logging.basicConfig(level=envs.LOOM_LOG_LEVEL,
                        format=f"%(asctime)s worker{rank} %(levelname)s %(message)s")
    config = EngineConfig.from_dict(config_dict)
    from workers import device_init
    device_init.start(config.device, local_rank)   # the CUDA context, while the imports below run
    from ipc.auth import ring_curve_client
    from shm.broadcast_ring import RemoteHandle, RingClosed, attach_reader
    ctx = zmq.Context()
    # a worker on another node replies over TCP: CURVE with the keys of the ring's auth key
    auth = ring_curve_client(ring_handle.auth_key) if isinstance(ring_handle, RemoteHandle) else None
    reply = make_socket(ctx, zmq.PUSH, reply_address, bind=False, linger=1000, auth=auth)
    enc = Encoder()
    send = lambda msg: reply.send_multipart(enc.encode(MsgType.WORKER_REPLY.value, msg), copy=False)
    ring = None
    code = 0
    try:
        try:
            ring = attach_reader(ring_handle, rank, envs.LOOM_WORKER_SPIN_MS / 1e3)
        except FileNotFoundError as e:   # the engine stopped (its ring removed) before this worker got there
            raise RingClosed(f"the step ring is gone ({e})") from None
        worker = Worker(config, rank, local_rank, rendezvous)
        freeze_startup_heap()
        send(WorkerReply(rank, result="ready"))
        with maybe_profile(f"worker{rank}"):
            serve_steps(worker, ring, send)
    except SystemExit:
        pass
    except RingClosed as e:   # the engine went away without a shutdown message: it reports why
        logger.info("worker %d: %s; exiting", rank, e)
        code = 1
    except Exception:
        logger.exception("worker %d failed", rank)
        try:
            send(WorkerReply(rank, error=traceback.format_exc()))
        except Exception:
            pass
        code = 1
    finally:
        if ring is not None:
            ring.close()
        reply.close()
        ctx.term()
        # Everything is released: skip the interpreter's teardown of torch (a second or more), so
        # that a stopping engine, and `loom serve` with it, exits at once.
        logging.shutdown()
        os._exit(code)
