"""The engine core: one busy-loop process.

    input thread  -> queue -> main loop (schedule, execute, update) -> output thread

The main loop blocks on the queue when there is nothing to run, so an idle
engine uses no CPU but for a heartbeat to every client each HEARTBEAT_S. Sockets: the engine connects a DEALER to each client's
input ROUTER (READY first, then it receives ADD/ABORT/UTILITY) and a PUSH to
each client's output PULL.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from ipc import envs
from ipc.config import ConfigError, EngineConfig
from engine_core.control import ControlState, Deferred, PauseState
from ipc.control import CONTROL_OPS, PAUSE_MODES, SLEEP_TAGS
from engine_core.client_io import ADD_MALFORMED, CLIENT_GONE, UTILITY_MALFORMED, ClientIO
from ipc.data_parallel import DPRank, register_with_head, select_devices
from engine_core.executor import Executor, MultiprocExecutor, PendingOutput
from engine_core.kv_events import KVEventBatch, ZmqEventPublisher, make_publisher
from engine_core.kv_offload import CPUTier
from engine_core.loop_stats import LoopStats
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from engine_core.structured_output import StructuredOutputManager
from ipc.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineLoad, EngineReady, GrammarOutput,
                          ModelRunnerOutput, MsgType, SchedulerOutput, UtilityOutput,
                          UtilityRequest)
from ipc.procs import child_signals, freeze_startup_heap, watch_parent
from ipc.profiling import maybe_profile
from ipc.serial import Encoder
from ipc.sockets import make_socket
from ipc.startup import StartupTimes
from ipc.validation import MAX_REQUEST_ID_CHARS, Limits, RequestError, validate_request
from shm.object_store import is_entry_handle
from ipc.worker_methods import ENGINE_ONLY_WORKER_METHODS

logger = logging.getLogger(__name__)
DEFERRED_POLL_S = 0.05   # how often a deferred reply that asks the workers asks them
HEARTBEAT_S = 1.0   # clients take an engine silent for several of these as stalled (docs/protocol.md)


_WAKE = b"wake"   # an input that only wakes the busy loop


class EngineCore:
    """Scheduling, execution and utility calls, with no sockets: easy to drive from tests, and
    driven in the caller's thread by the in-process client (frontend/inproc_client.py).
    EngineCoreProc adds the process's part: client connections, the input queue, the busy loop."""

    def __init__(self, config: EngineConfig, ipc_dir: str | None, executor_class: type[Executor] = MultiprocExecutor):
        self.config = config
        startup = StartupTimes(f"engine core {config.data_parallel_rank}")
        startup.since_process_start("imports")
        if executor_class is MultiprocExecutor and config.distributed_executor_backend == "ray":
            from engine_core.ray_executor import RayExecutor
            executor_class = RayExecutor
        with startup.phase("workers started (imports, weights)"):
            self.executor = executor_class(config, ipc_dir)
        with startup.phase("profiling run"):
            num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
        # --sliding-window-kv-trim: the window of the model's layers, when every one is local with one
        kv_window = self.executor.collective_rpc("kv_sliding_window")[0] if config.sliding_window_kv_trim else None
        config.check_num_blocks(num_blocks, kv_window)
        with startup.phase("KV cache, warm-up and graphs"):
            self.executor.collective_rpc("initialize_cache", [num_blocks])
        startup.log(logger)   # (each worker logs its own phases)
        self.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(config, num_blocks, StructuredOutputManager(config, wake=lambda: self.wake()),
                                   kv_window)
        self.limits = Limits.of(config)
        self.control = ControlState()
        self.max_in_flight = self._steps_ahead(config)
        # steps sent to the workers, oldest first, each with its output still to come
        self.in_flight: deque[tuple[SchedulerOutput, PendingOutput]] = deque()
        self.pending_outputs: dict[int, list[EngineCoreOutput]] = {}  # made outside a step (aborts by pause)
        self._deferred: list[tuple[int, UtilityOutput, Deferred]] = []   # utility replies not yet ready
        self.utility_outputs: list[UtilityOutput] = []   # replies for the in-process client (_send_utility)
        self.loop_stats = LoopStats()
        self.kv_events = self._kv_events_publisher(config)
        self._init_cpu_tier(config)
        logger.info("KV cache: %d blocks of %d tokens (--kv-cache-dtype %s)", num_blocks, config.block_size,
                    config.kv_cache_dtype)

    def _kv_events_publisher(self, config: EngineConfig) -> ZmqEventPublisher | None:
        """--kv-events-config: the publisher, and the block pool recording events for it."""
        try:
            publisher = make_publisher(config.kv_events_config, config.data_parallel_rank,
                                       envs.LOOM_ENGINE_AUTH_KEY or None)
        except (ValueError, TypeError, zmq.ZMQError) as e:
            raise ConfigError(f"--kv-events-config: {e}") from None
        if publisher is not None:
            self.scheduler.kv.pool.kv_events = []
        return publisher

    def _init_cpu_tier(self, config: EngineConfig) -> None:
        """--kv-offloading-size GiB over the tensor-parallel ranks: each rank holds the same slots of its heads."""
        if config.kv_offloading_size is None:
            return
        per_rank = config.kv_offloading_size * 2 ** 30 / config.tensor_parallel_size
        num_slots = int(per_rank // max(self.executor.collective_rpc("kv_block_bytes")))
        if num_slots < 1:
            raise ConfigError(f"--kv-offloading-size {config.kv_offloading_size} GiB holds no KV block")
        self.executor.collective_rpc("initialize_cpu_tier", [num_slots])
        pool = self.scheduler.kv.pool
        pool.cpu_tier = CPUTier(num_slots)
        pool.cpu_tier.kv_events = pool.kv_events
        logger.info("CPU KV tier: %d blocks (--kv-offloading-size %s GiB, backend %s)", num_slots,
                    config.kv_offloading_size, config.kv_offloading_backend or "native")

    def _send_kv_events(self) -> None:
        """The events of this turn as one batch, to the publisher's thread (no encoding here)."""
        events = self.scheduler.kv.pool.take_events()
        if events and self.kv_events is not None:
            self.kv_events.publish(KVEventBatch(time.time(), events))

    def _steps_ahead(self, config: EngineConfig) -> int:
        """Steps kept in flight. On a GPU with async scheduling three, so that this loop's round
        trip (step N's output in, step N+3 out) overlaps the worker's launch of step N+2 and the
        device's run of step N+1: with two, a batch-1 step cost the round trip plus the worker's
        launch in series (bench/RESULTS.md, session 8). On the CPU the worker computes a step as it
        launches it, and a third step would only compute tokens past a request's end: two.
        --steps-in-flight N (or LOOM_STEPS_IN_FLIGHT=N) sets it (A/B runs; the CPU tests of the GPU's three)."""
        if not config.async_scheduling:
            return 1
        if config.steps_in_flight is not None:
            return max(1, config.steps_in_flight)
        return 3 if self.executor.collective_rpc("device_type")[0] == "cuda" else 2

    # ------------------------------------------------------------ requests

    def add_request(self, ecr: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; a bad one fails alone with an error output."""
        error = self._validate(ecr)
        if error:  # the workers still hold a store reference to each real entry
            self.scheduler.release_mm([it for it in ecr.mm_items if is_entry_handle(it.store_name, it.store_addr)])
            return EngineCoreOutput(ecr.request_id, [], "error", error=error)
        seed = ecr.sampling_params.seed
        if seed is None:
            seed = random.getrandbits(62)
        self.scheduler.add_request(Request(ecr, self.config.max_model_len, seed))
        return None

    def _validate(self, ecr: EngineCoreRequest) -> str | None:
        """The same checks as the API server's (ipc/validation.py): attached clients are not trusted."""
        if len(ecr.request_id) > MAX_REQUEST_ID_CHARS:
            return f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(ecr.request_id)}"
        if ecr.request_id in self.scheduler.requests:
            return f"request id {ecr.request_id!r} is already in use"
        if ecr.lora_request is not None and not self.config.enable_lora:
            return "LoRA adapters are not enabled on this engine: start it with --enable-lora"
        if ecr.sampling_params.n != 1:
            return f"n must be 1 at the engine (a client fans n choices out into n requests), got {ecr.sampling_params.n}"
        if ecr.mm_items:
            if not self.config.mm_encoder_budget:
                return "this model takes no images (or was started with --language-model-only)"
            end, n = 0, len(ecr.prompt_token_ids)
            for it in ecr.mm_items:
                if it.offset < end or it.length < 1 or it.offset + it.length > n:
                    return "multimodal placeholder ranges must be sorted, disjoint and inside the prompt"
                if it.length > self.config.mm_encoder_budget:
                    return f"an image of {it.length} tokens exceeds the encoder budget ({self.config.mm_encoder_budget})"
                if not is_entry_handle(it.store_name, it.store_addr):
                    return "multimodal items must name entries of this host's multimodal store"
                end = it.offset + it.length
        try:
            validate_request(ecr.prompt_token_ids, ecr.sampling_params, self.limits, ecr.eos_token_ids,
                             ecr.priority)
        except RequestError as e:
            return str(e)
        except Exception as e:   # noqa: BLE001  (a check that itself broke on a client's input: the
            # request fails alone; the engine does not)
            logger.warning("request %s: validation raised %s: %s", ecr.request_id, type(e).__name__, e)
            return f"invalid request: {type(e).__name__}: {e}"
        return None

    def wake(self) -> None:
        """A grammar finished compiling (on its thread): the loop may have a request to schedule."""

    def abort_requests(self, req_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        """Whether stepping could make progress now (else the loop blocks on its input queue)."""
        return bool(self.in_flight) or self._can_schedule()

    def _can_schedule(self) -> bool:
        if not self.control.can_step:
            return False
        return (bool(self.scheduler.running) or (self.control.admits_new and self.scheduler.has_schedulable_waiting())
                or self.scheduler.has_releases())

    # ------------------------------------------------------------ one step

    def step(self) -> dict[int, list[EngineCoreOutput]]:
        """Schedule and run one step. With async scheduling, steps N+1 and N+2 are sent to
        the workers before step N's output is taken, so the GPU never waits for this loop.
        A step whose grammar bitmask needs step N's tokens runs its model at once and
        samples once they are in (vLLM's deferred sample_tokens)."""
        if len(self.in_flight) < self._in_flight_limit() and self._can_schedule():
            with self.loop_stats.phase("schedule"):
                so = self.scheduler.schedule(allow_new=self.control.admits_new)
            if (so.req_ids or so.new_requests or so.finished_req_ids or so.released_mm or so.free_encoder_hashes
                    or so.kv_transfers):
                with self.loop_stats.phase("submit"):
                    self.in_flight.append((so, self.executor.submit(so)))
                # (filled while this step was scheduled) after the step, which the worker holds until
                # this sample: it builds the step's host inputs meanwhile (workers/step_pipeline.py)
                self._send_bitmask()
                if so.defer_sample and len(self.in_flight) == 1:
                    self._sample_deferred(so)
                if len(self.in_flight) < self._in_flight_limit() and self._can_schedule():
                    return self.scheduler.update_from_output(ModelRunnerOutput([], []))  # fill the pipeline
        if not self.in_flight:
            return self.scheduler.update_from_output(ModelRunnerOutput([], []))
        outputs = self._take_oldest()
        if self._verifies_next() and self._can_schedule():
            # the step verifying the drafts just in goes to the workers now, before these outputs
            # are published: the device idles only for this loop's update and schedule (under
            # LOOM_SPEC_ASYNC the step after the one in flight, which must reach the worker
            # before that one ends: the worker places its drafts once it has finished it)
            with self.loop_stats.phase("schedule"):
                so = self.scheduler.schedule(allow_new=self.control.admits_new)
            if (so.req_ids or so.new_requests or so.finished_req_ids or so.released_mm or so.free_encoder_hashes
                    or so.kv_transfers):
                with self.loop_stats.phase("submit"):
                    self.in_flight.append((so, self.executor.submit(so)))
                self._send_bitmask()
                if so.defer_sample and len(self.in_flight) == 1:   # (else its bitmask follows the step before)
                    self._sample_deferred(so)
            for ci, outs in self.scheduler.update_from_output(ModelRunnerOutput([], [])).items():
                outputs.setdefault(ci, []).extend(outs)   # (requests the schedule failed, if any)
        return outputs

    def _verifies_next(self) -> bool:
        """Whether the next step goes out before the outputs just taken are published: the one
        that verifies their drafts (one step in flight while drafts wait), or under
        LOOM_SPEC_ASYNC a step of the pipeline as soon as it has room."""
        if self.scheduler.spec_async:
            return len(self.in_flight) < self._in_flight_limit()
        return not self.in_flight and self.scheduler.awaits_verification()

    def _in_flight_limit(self) -> int:
        """max_in_flight, or two while a step waits for its grammar bitmask: a worker holds one
        unsampled step at a time, and each bitmask needs every token before it."""
        if self.max_in_flight > 2 and any(so.defer_sample for so, _ in self.in_flight):
            return 2
        if self.scheduler.awaits_verification():   # a step's drafts come with the step before's output: one
            # in flight while there are drafts to verify (below disable_by_batch_size), the usual overlap else.
            # Under LOOM_SPEC_ASYNC only a constrained request's drafts wait here: the worker places the
            # others' in steps scheduled ahead (Scheduler._draft_slots)
            return 1
        return self.max_in_flight

    def _take_oldest(self) -> dict[int, list[EngineCoreOutput]]:
        """The oldest step's output; then the next step, if it waits for a bitmask, has its bitmask
        filled on the grammar manager's thread, sent with the next submit or take (or call to
        the workers): the loop schedules the step after meanwhile."""
        self._send_bitmask()   # the oldest step may be the one waiting for it
        so, pending = self.in_flight.popleft()
        with self.loop_stats.phase("wait"):
            result = pending.result()
        structured, nxt = self.scheduler.structured, self.in_flight[0][0] if self.in_flight else None
        ahead = nxt is not None and nxt.defer_sample and not nxt.scheduled_spec_decode_tokens
        if ahead:   # the next step's bitmask: its grammars advanced first, its fill beside the update
            with self.loop_stats.phase("accept"):
                structured.activated = False
                self.scheduler.accept_ahead(result, so.step_id)
            self._bitmask = structured.start_grammar_bitmask(nxt, self.scheduler.requests)
        with self.loop_stats.phase("update"):
            outputs = self.scheduler.update_from_output(result, so.step_id)
        if ahead and structured.activated:   # a grammar began to apply in the update: fill again
            self._bitmask.result()
            self._bitmask = structured.start_grammar_bitmask(nxt, self.scheduler.requests)
        elif nxt is not None and nxt.defer_sample and not ahead:   # a verify step's rows need every draft in
            self._bitmask = structured.start_grammar_bitmask(nxt, self.scheduler.requests)
        return outputs

    _bitmask: Future | None = None   # the oldest step's bitmask being filled, not yet sent

    def _send_bitmask(self) -> None:
        """Send the bitmask being filled (if any) to the worker, which then samples its step."""
        if self._bitmask is not None:
            job, self._bitmask = self._bitmask, None
            with self.loop_stats.phase("bitmask"):
                self.executor.sample(job.result() or GrammarOutput([], None))

    def _sample_deferred(self, so: SchedulerOutput) -> None:
        self.executor.sample(self.scheduler.grammar_bitmask(so) or GrammarOutput([], None))

    def step_with_pending(self) -> dict[int, list[EngineCoreOutput]]:
        """One turn of the loop: a step if there is work, after the outputs made outside a step."""
        by_client = self.step() if self.has_work() else {}
        for ci, outs in self.pending_outputs.items():
            by_client.setdefault(ci, [])[:0] = outs
        self.pending_outputs = {}
        self._send_kv_events()
        return by_client

    def drain(self) -> dict[int, list[EngineCoreOutput]]:
        """Take every step in flight (before control calls that touch the workers)."""
        outs: dict[int, list[EngineCoreOutput]] = {}
        while self.in_flight:
            for ci, o in self._take_oldest().items():
                outs.setdefault(ci, []).extend(o)
        return outs

    # ------------------------------------------------------------ control calls (ipc/control.py)

    def control_call(self, name: str, args: list) -> Any:
        """Run control operation `name` for a client, as its row in ipc/control.py says: only
        operations declared there; steps in flight are taken first when it drains; refused while
        requests step when it needs the engine paused. The engine method of its name does the rest
        (its answer, or a Deferred one)."""
        op = CONTROL_OPS.get(name)
        if op is None:
            raise ValueError(f"unknown utility method {name!r}")
        if op.drains:   # control calls see (and workers finish) every step sent
            for ci, outs in self.drain().items():
                self.pending_outputs.setdefault(ci, []).extend(outs)
        if op.needs_pause:
            self._check_not_stepping()
        return getattr(self, op.name)(*args)

    def _on_workers(self, name: str, args: list) -> Any:
        """Control operation `name`'s worker method on every worker; their answers merged as declared."""
        self._send_bitmask()
        op = CONTROL_OPS[name]
        return op.ranks(self.executor.collective_rpc(op.workers, args))

    def _run_utility(self, req: UtilityRequest) -> None:
        out = UtilityOutput(req.call_id)
        try:
            result = self.control_call(req.method, req.args)
            if isinstance(result, Deferred):
                self._deferred.append((req.client_index, out, result))
                return
            out.result = result
        except Exception as e:
            out.failure = f"{type(e).__name__}: {e}"
        self._send_utility(req.client_index, out)

    def _finish_deferred(self) -> None:
        for item in list(self._deferred):
            client_index, out, deferred = item
            try:
                if not deferred.done():
                    continue
                out.result = deferred.result
            except Exception as e:
                out.failure = f"{type(e).__name__}: {e}"
            self._deferred.remove(item)
            self._send_utility(client_index, out)

    def _send_utility(self, client_index: int, out: UtilityOutput) -> None:
        """A utility reply, kept for the in-process client (the process sends it to its client)."""
        self.utility_outputs.append(out)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str, load_inplace: bool = False) -> bool:
        """Read and check an adapter on every worker (LoRAAdapterError: nothing is kept). In place
        (load_inplace), its new weights make the KV computed with the old ones stale, as a weight
        update does: running requests recompute, and the prefix cache is reset."""
        self._check_lora()
        ok = self._on_workers("add_lora", [lora_name, lora_int_id, lora_path, bool(load_inplace)])
        if load_inplace:
            self._weights_updated(True)
        return ok

    def remove_lora(self, lora_int_id: int) -> bool:
        self._check_lora()
        return self._on_workers("remove_lora", [lora_int_id])

    def list_loras(self) -> list[int]:
        self._check_lora()
        return self._on_workers("list_loras", [])

    def _check_lora(self) -> None:
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")

    def sleep(self, level: int = 1) -> None:
        """0: stop scheduling. 1: also offload weights to CPU and free the KV cache. 2: discard both."""
        if type(level) is not int or level not in (0, 1, 2):   # (1.0 or True went out in the stats, an
            # int field every client's decoder then refused: their outputs were dropped with them)
            raise ValueError(f"level must be 0, 1 or 2, got {level!r}")
        if level == 0:
            self.control.asleep.add("scheduling")
        else:
            if not self.config.enable_sleep_mode:
                raise ValueError("sleep levels 1 and 2 need --enable-sleep-mode")
            self.scheduler.preempt_all()  # their KV is about to go; they recompute after wake-up
            self._on_workers("sleep", [level])
            self.scheduler.reset_prefix_cache(keep_cpu_tier=level == 1)   # level 2: the weights may change
            # (not "scheduling": waking weights and kv_cache, as RL trainers do, ends the sleep)
            self.control.asleep.update(("weights", "kv_cache"))
        self.control.sleep_level = max(self.control.sleep_level, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(tags or SLEEP_TAGS)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake-up tags {unknown}; use {list(SLEEP_TAGS)}")
        self._wake(tags)

    def _wake(self, tags: list[str], weights_dir: str | None = None, load_format: str | None = None) -> int:
        """Wake `tags`; level-2 weights load from weights_dir (default: the checkpoint last loaded).
        The tensors loaded."""
        worker_tags = [t for t in ("weights", "kv_cache") if t in tags and t in self.control.asleep]
        loaded = 0
        if worker_tags:
            loaded = self._on_workers("wake_up", [worker_tags, weights_dir, load_format])
        self.control.asleep.difference_update(tags)
        if not self.control.asleep:
            self.control.sleep_level = 0
        return loaded

    def is_sleeping(self) -> bool:
        return self.control.is_sleeping

    def pause(self, mode: str = "abort", clear_cache: bool = False):
        """abort: end in-flight requests; wait: return once they finish; keep: freeze them."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        if mode == "keep":
            self.control.pause = PauseState.PAUSED_ALL
            if clear_cache:  # never wait on frozen requests: recompute them after resume instead
                self.scheduler.preempt_all()
                self.scheduler.reset_prefix_cache()
            return None
        self.control.pause = PauseState.PAUSED_NEW
        if mode == "abort":
            self._abort_all()
            if clear_cache:
                self.scheduler.reset_prefix_cache()
            return None

        def drained() -> bool:
            if self.scheduler.running:
                return False
            if clear_cache:
                self.scheduler.reset_prefix_cache()
            return True
        return Deferred(drained)

    def resume(self) -> None:
        self.control.pause = PauseState.UNPAUSED

    def is_paused(self) -> bool:
        return self.control.pause != PauseState.UNPAUSED

    def _abort_all(self) -> None:
        reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for req in self.abort_requests([r.request_id for r in reqs]):
            self.pending_outputs.setdefault(req.client_index, []).append(
                EngineCoreOutput(req.request_id, [], "abort"))

    def ping(self) -> str:
        return "pong"

    # ------------------------------------------------------------ weight updates (RL trainers)

    def _check_not_stepping(self) -> None:
        """Weights change only while no request steps: paused (keep; or abort / wait once
        drained) or asleep (control operations with needs_pause)."""
        c = self.control
        if c.can_step and c.admits_new:
            raise ValueError("the engine is running: pause it first (pause(mode='keep') or POST /pause?mode=keep), "
                             "update the weights, then resume")
        if c.can_step and self.scheduler.running:
            raise ValueError("requests are still running (pause(mode='wait') has not returned): wait for it, "
                             "or pause with mode='keep'")

    def _check_weights_awake(self, doing: str = "updating") -> None:
        if "weights" in self.control.asleep:   # (asleep, the parameters are empty)
            raise ValueError(f"the weights are asleep: wake_up(tags=['weights']) before {doing} them")

    def _update_weights(self, name: str, args: list, flush_cache: bool) -> int:
        """A weight update on every worker; the tensors loaded."""
        self._check_weights_awake()
        n = self._on_workers(name, args)
        self._weights_updated(flush_cache)
        return n

    def _weights_updated(self, flush_cache: bool) -> None:
        """After new weights, the KV of running requests and the prefix cache are stale: running
        requests recompute (so their next tokens equal a fresh engine's on the new weights)."""
        if flush_cache:
            self.scheduler.preempt_all()
            if not self.scheduler.reset_prefix_cache():  # every block is free once nothing runs
                raise RuntimeError("the prefix cache could not be reset after a weight update")

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto", flush_cache: bool = True) -> int:
        if "weights" in self.control.asleep and self.control.sleep_level == 2:
            # discarded (level 2): the checkpoint is loaded as they wake, which is also the way out
            # when the one they would reload from no longer loads
            n = self._wake(["weights"], model_path, load_format)
            self._weights_updated(flush_cache)
            return n
        return self._update_weights("update_weights_from_disk", [model_path, load_format], flush_cache)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True) -> int:
        return self._update_weights("update_weights_from_distributed", [names, dtypes, shapes, group_name],
                                    flush_cache)

    def update_weights_from_tensor(self, named_tensors: list, flush_cache: bool = True) -> int:
        return self._update_weights("update_weights_from_tensor", [named_tensors], flush_cache)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> Deferred:
        """Answered once every worker is in the trainer's group. The join waits for the trainer (up
        to LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S), so it runs beside the loop, which keeps stepping."""
        self._on_workers("init_weights_update_group",
                         [master_address, master_port, rank_offset, world_size, group_name, backend])
        return Deferred(self._poll_workers("weights_update_group_ready", [group_name]))

    def _poll_workers(self, method: str, args: list) -> Callable[[], bool]:
        """A Deferred's done(): whether every worker answers `method` with True, asked at most every
        DEFERRED_POLL_S. Steps in flight are taken first: the workers answer calls between steps."""
        next_poll = 0.0

        def done() -> bool:
            nonlocal next_poll
            if time.monotonic() < next_poll:
                return False
            for ci, outs in self.drain().items():
                self.pending_outputs.setdefault(ci, []).extend(outs)
            next_poll = time.monotonic() + DEFERRED_POLL_S
            return all(self.executor.collective_rpc(method, args))
        return done

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._on_workers("destroy_weights_update_group", [group_name])

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        self._check_weights_awake("reading")   # (the parameters are empty: it answered [])
        return self._on_workers("get_weights_by_name", [name, truncate_size])[:truncate_size]

    # ------------------------------------------------------------ profiler

    def start_profile(self, profile_prefix: str | None = None) -> list[str]:
        """Start the torch profiler in every worker; the trace names, by rank."""
        return self._on_workers("start_profile", [profile_prefix])

    def stop_profile(self) -> list[str]:
        return self._on_workers("stop_profile", [])

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run a @remote worker method on every worker; their results, by rank."""
        if not isinstance(method, str):
            raise ValueError(f"collective_rpc method must be a string, got {type(method).__name__}")
        if method in ENGINE_ONLY_WORKER_METHODS or method.startswith("_"):
            raise ValueError(f"method {method!r} is not callable on workers through collective_rpc")
        if not isinstance(args or [], list) or not isinstance(kwargs or {}, dict) \
                or not all(isinstance(k, str) for k in kwargs or {}):   # a worker could not decode the call
            raise ValueError("collective_rpc args must be a list and kwargs an object with string keys")
        self._send_bitmask()
        return self.executor.collective_rpc(method, args or [], kwargs or {}, timeout)

    def debug_info(self) -> dict:
        """Counts for leak checks. No gc.collect(): a request kept alive only by a cycle must show."""
        return {"live_requests": len(Request.live), "tracked_requests": len(self.scheduler.requests),
                "free_blocks": self.scheduler.kv.pool.num_free_blocks, "num_blocks": self.num_gpu_blocks,
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "output_tokens": sum(len(r.output_token_ids) for r in self.scheduler.requests.values())}

    shutting_down = False

    def shutdown(self) -> None:
        self.shutting_down = True
        self.loop_stats.log()
        self.scheduler.structured.shutdown()
        self.executor.shutdown()
        if self.kv_events is not None:
            self._send_kv_events()
            self.kv_events.shutdown()


class EngineCoreProc(EngineCore):
    """The engine-core process: EngineCore plus its client connections (ClientIO)."""

    def __init__(self, config: EngineConfig, ipc_dir: str, clients: list[tuple[str, str]],
                 handshake_address: str | None = None, auth_key: str | None = None, engine_index: int = 0,
                 serves_a_head: bool = False):
        if handshake_address:
            check_handshake_security(handshake_address, auth_key)
        super().__init__(config, ipc_dir)
        self.engine_index = engine_index
        # a data-parallel rank of another node's head: it ends with the head (its API servers), or it
        # would run on unused and never register with a restarted head
        self.serves_a_head = serves_a_head
        self.inputs: queue.Queue = queue.Queue()
        self._published_step, self._published_control, self._published_load = 0, (0, False), (0, 0)
        self.num_added: dict[int, int] = {}   # ADDs taken in, by client: its requests not yet counted elsewhere
        ready = EngineReady(config.max_model_len, self.num_gpu_blocks, config.block_size,
                            engine_index, config.model_name, scheduling_policy=config.scheduling_policy)
        self.io = ClientIO(ready, self.inputs, clients, handshake_address, auth_key, config.attached_output_hwm)
        self.io.start()

    def wake(self) -> None:
        self.inputs.put((_WAKE, None))

    def send_dead(self, reason: str) -> None:
        self.io.send_dead(reason)

    def debug_info(self) -> dict:
        return {**super().debug_info(), "clients": len(self.io.live)}

    def shutdown(self) -> None:
        super().shutdown()
        self.io.close()

    # ------------------------------------------------------------ main loop

    def run_busy_loop(self) -> None:
        self._last_beat = 0.0
        while True:
            self._drain_inputs(block=not self.has_work() and not self.pending_outputs,
                               timeout=DEFERRED_POLL_S if self._deferred else HEARTBEAT_S)
            by_client = self.step_with_pending()
            with self.loop_stats.phase("publish"):
                self._publish(by_client)
            self._finish_deferred()  # after the outputs a deferred reply waited for have gone out

    def _publish(self, by_client: dict[int, list[EngineCoreOutput]]) -> None:
        """Send outputs, finished-request timings, this step's stats (to one client) and the load
        (waiting, running) that data-parallel clients route by (to every client when DP > 1)."""
        step = self.scheduler.step_id
        control = (self.control.sleep_level, self.is_paused())
        load = (len(self.scheduler.waiting), len(self.scheduler.running))
        if (not by_client and step == self._published_step and control == self._published_control
                and load == self._published_load and not self.scheduler.has_timings()):
            self._heartbeat()
            return  # nothing new (a sleep / pause change, or an abort's timing, is reported even without a step)
        load_changed = load != self._published_load
        self._published_step, self._published_control, self._published_load = step, control, load
        stats = self.scheduler.make_stats()
        stats.sleep_level, stats.is_paused = control
        timings: dict[int, list] = {}
        for ci, t in self.scheduler.take_timings():
            timings.setdefault(ci, []).append(t)
        live = self.io.client_indices()
        stats_client = live[step % len(live)] if live else None
        targets = set(by_client) | set(timings) | ({stats_client} if live else set())
        if self.config.data_parallel_size > 1 or load_changed:
            # every client routes by the load; and an API server attached on its own (its
            # /metrics not merged with the others') keeps its gauges current: they stayed busy
            targets |= set(live)
        gauges = stats.gauges_only() if len(targets) > 1 else None
        now = time.time()
        for ci in targets:
            # the step's counters go to one client (the API servers of one `loom serve` sum them),
            # the gauges to every client a message goes to
            self.io.send(ci, MsgType.OUTPUTS.value, EngineCoreOutputs(
                by_client.get(ci, []), self.engine_index, now,
                stats if ci == stats_client else gauges, None, timings.get(ci, []),
                EngineLoad(*load, self.num_added.get(ci, 0))))
        self._heartbeat()

    def _heartbeat(self) -> None:
        """Every client hears from the loop at least every HEARTBEAT_S, busy or idle, so an API server
        can tell an engine that stopped stepping (SIGSTOP, a hung step) from an idle one (/health)."""
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_S:
            return
        if not self.io.healthy():
            raise RuntimeError("a client I/O thread of the engine core died")
        self._last_beat = now
        self.io.send(-1, MsgType.OUTPUTS.value, EngineCoreOutputs([], self.engine_index, time.time()))

    def _drain_inputs(self, block: bool, timeout: float) -> None:
        try:
            item = self.inputs.get(timeout=timeout) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_input(*item)
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _handle_input(self, kind: bytes, msg: Any) -> None:
        if kind == MsgType.ADD.value:
            self.num_added[msg.client_index] = self.num_added.get(msg.client_index, 0) + 1
            err = self.add_request(msg)
            if err is not None:
                self.pending_outputs.setdefault(msg.client_index, []).append(err)
        elif kind == ADD_MALFORMED:  # counted as an ADD: a DP router acknowledges its ADDs by this count
            client_index, request_id, error = msg
            self.num_added[client_index] = self.num_added.get(client_index, 0) + 1
            self.pending_outputs.setdefault(client_index, []).append(
                EngineCoreOutput(request_id, [], "error", error=error))
        elif kind == MsgType.ABORT.value:
            client_index, req_ids = msg
            self.abort_requests(self._own_requests(client_index, req_ids))
        elif kind == MsgType.UTILITY.value:
            self._run_utility(msg)
        elif kind == UTILITY_MALFORMED:
            client_index, call_id, error = msg
            self._send_utility(client_index, UtilityOutput(call_id, failure=error))
        elif kind == CLIENT_GONE:
            self.num_added.pop(msg, None)
            self.abort_requests([r.request_id for r in list(self.scheduler.requests.values())
                                 if r.client_index == msg])
            self._deferred = [d for d in self._deferred if d[0] != msg]
            if self.serves_a_head and not self.io.live:
                raise HeadGone("every API server of the head disconnected: the head is gone")

    def _own_requests(self, client_index: int, req_ids: list[str]) -> list[str]:
        """Those of `req_ids` that client_index added: request ids are the clients' own, so one
        attached client cannot end another's request by naming its id."""
        reqs = self.scheduler.requests
        return [rid for rid in req_ids if rid in reqs and reqs[rid].client_index == client_index]

    def _send_utility(self, client_index: int, out: UtilityOutput) -> None:
        self.io.send(client_index, MsgType.OUTPUTS.value,
                     EngineCoreOutputs([], self.engine_index, time.time(), utility_output=out))


class HeadGone(Exception):
    """The API servers of the head this data-parallel rank served have all disconnected."""


def check_handshake_security(address: str, auth_key: str | None) -> None:
    """Anyone who reaches a TCP handshake socket could drive the engine: off loopback, require a key."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if not auth_key and host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"--engine-address {address} is reachable from the network: set --engine-auth-key "
                          f"(or LOOM_ENGINE_AUTH_KEY) so that only your clients can attach")


def run_engine_core(config_dict: dict, ipc_dir: str, clients: list[tuple[str, str]],
                    handshake_address: str | None, auth_key: str | None, dp: DPRank | None, death_pipe) -> None:
    """Process entry point. `dp`: this engine's data-parallel rank (None: the only engine)."""
    # a SIGKILLed parent cannot remove them: this engine's directory and, under data parallelism
    # (ipc_dir is then the launcher's directory's dp{rank}), the launcher's too
    watch_parent(death_pipe, remove_dirs=(ipc_dir,) if dp is None else (ipc_dir, os.path.dirname(ipc_dir)))
    child_signals()
    name = "engine" if dp is None else f"engine{dp.rank}"
    logging.basicConfig(level=envs.LOOM_LOG_LEVEL,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
    config = EngineConfig.from_dict(config_dict)
    config.data_parallel_rank = dp.rank if dp is not None else 0
    if dp is not None and config.device != "cpu" and config.data_parallel_size > 1:
        select_devices(dp.local_rank, config.tensor_parallel_size)   # before any worker starts
    sys.setswitchinterval(envs.LOOM_ENGINE_SWITCH_INTERVAL_MS / 1e3)
    if envs.LOOM_DEBUG_DISABLE_GC:
        import gc
        gc.disable()  # leak tests: finished requests must be freed by reference counting alone
    engine = None
    code = 0
    try:
        engine = EngineCoreProc(config, ipc_dir, clients, handshake_address, auth_key,
                                engine_index=dp.rank if dp is not None else 0,
                                serves_a_head=dp is not None and bool(dp.register_address))
        _watch_workers(engine)
        freeze_startup_heap()
        if dp is not None and dp.register_address:   # on another node: the head's API servers attach now
            try:
                register_with_head(dp.register_address, dp.rank, engine.io.handshake_endpoint, auth_key)
            except PermissionError as e:   # a wrong key, a rank already there: the command line's mistake
                raise ConfigError(str(e)) from None
        with maybe_profile("engine_core"):
            engine.run_busy_loop()
    except SystemExit:   # SIGTERM: tell the clients at once, rather than when the sockets close
        if engine is not None:
            engine.send_dead("the engine core was stopped (SIGTERM)")
    except ConfigError as e:
        logger.error("%s", e)
        _report_startup_failure(clients, str(e))
        code = 2
    except HeadGone as e:
        logger.error("%s; exiting", e)
        code = 1
    except BaseException as e:
        logger.error("engine core failed: %s\n%s", e, traceback.format_exc())
        if engine is not None:
            engine.send_dead(f"engine core failed: {e}")
        else:
            _report_startup_failure(clients, f"engine core failed to start: {e}")
        code = 1
    finally:
        if engine is not None:
            engine.shutdown()
    os._exit(code)


def _report_startup_failure(clients: list[tuple[str, str]], reason: str) -> None:
    """Tell every client why the engine never became ready."""
    ctx = zmq.Context()
    frames = Encoder().encode(MsgType.ENGINE_DEAD.value, reason)
    for _, out_addr in clients:
        sock = make_socket(ctx, zmq.PUSH, out_addr, bind=False, linger=1000)
        sock.send_multipart(frames)
        sock.close()
    ctx.term()


def _watch_workers(engine: EngineCoreProc) -> None:
    """A dead worker takes the engine down at once, telling every client first."""
    from multiprocessing.connection import wait

    def _watch():
        wait(engine.executor.sentinels())
        if engine.shutting_down:
            return
        reason = engine.executor.dead_worker() or "a worker exited"
        logger.error("%s; engine core shutting down", reason)
        engine.send_dead(reason)
        os._exit(1)
    threading.Thread(target=_watch, name="worker-watch", daemon=True).start()
