"""AsyncLLM: what an API server talks to. Tokenizer + engine client + output processing.

Outputs are turned into deltas (detokenized, stop strings, metrics) as they
arrive, for every request at once; the stream `generate()` returns yields what
has piled up for its request as one RequestOutput, or pushes each step's output
to a callable (RequestStream.push: a streamed response's writer). If its consumer
goes away (a client disconnects and the handler is cancelled), the request is
aborted in the engine.
"""
from __future__ import annotations

import asyncio
import copy
import time
from typing import Any, AsyncIterator

from frontend.engine_client import AsyncEngineCoreClient, EngineDeadError
from ipc import envs
from ipc.config import EngineConfig
from ipc.control import merge_results
from frontend.dp_router import DPRouter, check_rank
from frontend.detokenizer import TokenTexts
from frontend.output_processor import RequestState
from frontend.outputs import CompletionOutput, RequestOutput
from frontend.processing import engine_requests, load_tokenizer
from ipc.lora import LoRARequest
from ipc.messages import INTERNAL_ERROR, EngineCoreOutput, EngineCoreOutputs
from ipc.sampling_params import SamplingParams
from metrics.request_metrics import RequestMetrics
from multimodal.processor import make_mm_processor
from workers.models.registry import multimodal_info

ATTACH_TIMEOUT_S = 30.0   # for the engine at --engine-address (or a remote rank) to answer the handshake


class _Collector:
    """One user request in this API server: the state and metrics of each of its choices, and
    the deltas that _on_outputs made but generate() has not taken yet. Deltas pile up while the
    consumer is busy and are taken together, so a slow client gets fewer, larger deltas (vLLM's
    RequestOutputCollector).

    A consumer that can take an output at once (a stream's writer: RequestStream.push) sets `sink`:
    the deltas then go to it from _on_outputs, in the engine output's own turn of the loop, and
    the consumer's task is woken only at the end, on an error, or when the sink refuses (its
    client's socket buffer is full: the consumer then takes them and waits for the socket). The
    task switch, the four coroutine layers and aiohttp's write path that a chunk went through
    otherwise were about a quarter of the API server's CPU at c512 (py-spy, CPU box)."""

    __slots__ = ("request_id", "prompt_token_ids", "states", "metrics", "unfinished", "num_cached_tokens",
                 "deltas", "error", "_waiter", "engine", "interval", "_pending", "_started", "_loop", "sink",
                 "_ready", "_due")

    def __init__(self, request_id: str, prompt_token_ids: list[int], states: dict[str, RequestState],
                 metrics: dict[str, RequestMetrics], engine: int = 0, interval: int = 1, ready: list | None = None):
        self.request_id = request_id   # the user request's id (its outputs carry it)
        self.prompt_token_ids = prompt_token_ids
        self.engine = engine   # the engine core (data-parallel rank) it runs on
        self.states = states
        self.metrics = metrics
        self.unfinished = set(states)
        self.num_cached_tokens = 0
        self.deltas: list[CompletionOutput] = []
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        # --stream-interval: the consumer is woken once this many tokens wait (or at the first and
        # the last): one chunk, one socket write, for several tokens
        self.interval = interval
        self._pending = 0
        self._started = False
        # made in generate(), on the loop: asyncio.get_running_loop() is a getpid() system call
        # per call on Python 3.11, and take() waits once per chunk
        self._loop = asyncio.get_running_loop()
        # callable(RequestOutput) -> bool: False when it took nothing (RequestStream.push)
        self.sink = None
        # where it puts itself when it has deltas for its consumer, to be handed over (hand_over)
        # once every output of the engine's step is processed: one chunk, one write, for all of a
        # request's choices (None: handed over at once)
        self._ready = ready
        self._due = False

    def process(self, out: EngineCoreOutput, now: float) -> bool:
        """Turn one engine output into a delta. True: a stop string ended it here (abort in the engine)."""
        rid = out.request_id
        if rid not in self.unfinished:
            return False
        st = self.states[rid]
        if out.error is not None and not st.token_ids and out.stop_reason != INTERNAL_ERROR:  # the engine refused it
            self.unfinished.discard(rid)
            self.metrics[rid].finish("error", now)
            self.fail(ValueError(out.error))
            return False
        delta, abort = st.process(out)
        if delta is not None:
            n, finish_reason = len(delta.token_ids), delta.finish_reason
            metrics = self.metrics[rid]
            metrics.num_cached_tokens = self.num_cached_tokens = st.num_cached_tokens
            metrics.on_output(now, n, finish_reason)
            if finish_reason is not None:
                self.unfinished.discard(rid)
            self.deltas.append(delta)
            self._pending += n
            if self.interval <= 1 or not self._started or finish_reason is not None or self._pending >= self.interval:
                self._started = True
                if self._ready is None:
                    self.hand_over()
                elif not self._due:
                    self._due = True
                    self._ready.append(self)
        return abort

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake_consumer()

    def hand_over(self) -> None:
        """This step's deltas to the sink, or the consumer woken for them."""
        self._due = False
        if self.sink is None or self.error is not None or not self._push():
            self._wake_consumer()

    def _wake_consumer(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _push(self) -> bool:
        """Every delta to the sink. True: it took them and the consumer has nothing to do yet."""
        try:
            if not self.sink(self.output(self.deltas)):
                return False
        except Exception as e:  # noqa: BLE001  (the consumer's to raise, as if it had taken the deltas)
            self.error = e
            return False
        self.deltas = []
        self._pending = 0
        return bool(self.unfinished)

    def output(self, deltas: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(self.request_id, None, self.prompt_token_ids, _merge(deltas), not self.unfinished,
                             self.num_cached_tokens)

    async def take(self) -> list[CompletionOutput]:
        """Every delta made since the last call, waiting for one if there is none ([] at the
        end, when the sink took the last)."""
        while not self.deltas and self.error is None and self.unfinished:
            self._waiter = self._loop.create_future()
            await self._waiter
        if self.error is not None:
            raise self.error
        deltas, self.deltas = self.deltas, []
        self._pending = 0
        return deltas


class RequestStream:
    """What AsyncLLM.generate() returns: the request's RequestOutputs, taken with `async for`, or,
    once the first was taken, pushed to a callable as they come (push)."""

    __slots__ = ("gen", "collector")

    def __init__(self):
        self.gen = None         # the async generator of AsyncLLM._generate
        self.collector = None   # its _Collector, once it runs

    def __aiter__(self):
        return self

    def __anext__(self):
        return self.gen.__anext__()

    def aclose(self):
        return self.gen.aclose()

    def push(self, sink) -> bool:
        """From now on, sink(RequestOutput) -> bool gets every output in the turn of the loop that
        made it; an output it refuses (False: it took nothing), and the end, still come through
        `async for`, which the caller keeps running. An exception in sink ends the stream with it.
        False: the request has not started (nothing will be pushed)."""
        if self.collector is None:
            return False
        self.collector.sink = sink
        return True


class AsyncLLM:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str, client_index: int = 0):
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.tokenizer_source = config.tokenizer_dir   # for the API server's tokenizer process (the same files)
        self.token_texts = TokenTexts(self.tokenizer)
        self.mm = make_mm_processor(config, client_index, multimodal_info)   # None for a text-only model
        self.client = AsyncEngineCoreClient(input_address, output_address, client_index,
                                            self._on_outputs, self._on_dead, config.data_parallel_size)
        self.router = DPRouter(config.data_parallel_size, config.block_size, client_index, config.max_num_seqs)
        self._requests: dict[str, _Collector] = {}   # engine request id -> its user request
        self._ready: list[_Collector] = []   # those with deltas for their consumer (_Collector._ready)
        self._background: set[asyncio.Task] = set()
        self.stat_listeners: list = []   # callables(EngineCoreOutputs), e.g. metrics
        self.stat_logger = None          # metrics.PrometheusStatLogger: gets each request's RequestMetrics
        self.draining = False            # shutting down: new requests are refused (frontend/openai/api_server_proc.py)
        self.stream_interval = 1         # --stream-interval: tokens gathered per delta (set by the API server)

    async def start(self, timeout: float = 900.0, engine_address: str | None = None,
                    auth_key: str | None = None, remote_engines: list[str] = ()) -> None:
        """Wait for every engine's READY; first attach to the engine at engine_address, or to the
        data-parallel ranks on other nodes at their handshake addresses (remote_engines)."""
        addresses = [engine_address] if engine_address else list(remote_engines)
        # an engine that is there answers at once: 30 s, not the start-up timeout, before giving up
        await asyncio.gather(*(self.client.attach_handshake(a, auth_key, min(timeout, ATTACH_TIMEOUT_S))
                               for a in addresses))
        ready = await self.client.wait_ready(timeout)
        if engine_address:   # the engine's limits, not this command's flags, decide what it takes
            self.config.max_model_len, self.config.scheduling_policy = ready.max_model_len, ready.scheduling_policy

    @property
    def client_index(self) -> int:
        """This API server's index at the engine (given by the engine when attached from elsewhere)."""
        return self.client.client_index

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def engine_stalled(self) -> bool:
        """An engine (any data-parallel rank) has sent nothing, not even its heartbeat (one a second:
        engine_core/core.py), for LOOM_ENGINE_STALL_S: it stopped stepping."""
        return self.client.silent_for() > envs.LOOM_ENGINE_STALL_S

    @property
    def num_in_flight(self) -> int:
        """User requests this server is generating for."""
        return len(set(self._requests.values()))

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (shutdown); each is then aborted in the engine."""
        for req in set(self._requests.values()):
            req.fail(error)

    # ------------------------------------------------------------ outputs in

    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        """Every output is detokenized and counted here, as it arrives, once per engine step."""
        now = time.monotonic()  # when these outputs reached the frontend, for latency metrics
        if self.mm is not None:
            self.mm.store.maybe_unlink()
        if outs.load is not None:
            self.router.on_load(outs.engine_index, outs.load)
        if self.stat_logger is not None:   # what processing records (a finish: its success, latencies) is of
            self.stat_logger.use_engine(outs.engine_index)   # this engine's requests, not the last sender's
        stopped = []
        ready = self._ready
        for out in outs.outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            try:
                if req.process(out, now):
                    stopped.append(out.request_id)
            except Exception as e:  # noqa: BLE001  (one request's failure must not stop the others')
                req.fail(e)
        for req in ready:
            req.hand_over()
        ready.clear()
        for listener in self.stat_listeners:   # after the outputs: metrics write this step's tokens at once
            listener(outs)
        if stopped:
            self._in_background(self.client.abort(stopped, outs.engine_index))

    def _on_dead(self, reason: str | None) -> None:
        for req in set(self._requests.values()):
            req.fail(EngineDeadError(reason or self.dead_reason))

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)   # the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ requests

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 mm_items: list | None = None, data_parallel_rank: int | None = None,
                 priority: int = 0, group_id: str = "", lora_request: LoRARequest | None = None) -> RequestStream:
        """The caller has validated the request (ipc/validation.py; the API server does, before it
        answers); the engine checks it again and fails a bad one alone (a ValueError here).
        mm_items: the prompt's images, already in this server's store (one reference, taken over
        here: every engine request holds one, given back by the engine when it ends).
        data_parallel_rank pins the request to that engine core; else the router picks one.
        priority: its place under --scheduling-policy priority (lower runs first).
        group_id: the HTTP request's id when it is one of its several prompts: the engine shares
        its batch slots fairly between groups (engine_core/fairness.py).
        Nothing runs until the stream's first output is asked for (as an async generator's body)."""
        stream = RequestStream()
        stream.gen = self._generate(stream, prompt_token_ids, params, request_id, mm_items, data_parallel_rank,
                                    priority, group_id, lora_request)
        return stream

    async def _generate(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams,
                        request_id: str, mm_items: list | None, data_parallel_rank: int | None, priority: int,
                        group_id: str, lora_request: LoRARequest | None) -> AsyncIterator[RequestOutput]:
        if self.is_dead:
            if mm_items:
                self.mm.unref(mm_items)
            raise EngineDeadError(self.dead_reason)
        try:
            rank = None if data_parallel_rank is None else check_rank(data_parallel_rank, self.router.n)
            if mm_items and rank in self.router.remote:
                raise ValueError(f"data-parallel rank {rank} runs on another node, where this server's "
                                 f"images cannot be read: pin a rank of this node, or none")
        except ValueError:
            if mm_items:   # they never reach an engine
                self.mm.unref(mm_items)
            raise
        arrival = time.monotonic()
        ecrs = engine_requests(request_id, prompt_token_ids, params, self.config.eos_token_ids, time.time(),
                               priority, group_id, lora_request)
        if any(ecr.request_id in self._requests for ecr in ecrs):
            # (vLLM's words) registering it again would hand the running request's outputs to this one
            if mm_items:
                self.mm.unref(mm_items)
            raise ValueError(f"Request id {request_id} already running.")
        if rank is not None:
            engine = self.router.pinned(rank, len(ecrs))
        else:
            engine = self.router.pick(prompt_token_ids, len(ecrs), local_only=bool(mm_items),
                                      avoid=self.client.silent_engines(envs.LOOM_ENGINE_STALL_S))
        if mm_items:
            self.mm.addref(mm_items, len(ecrs) - 1)
            for ecr in ecrs:
                ecr.mm_items = mm_items
        states = {ecr.request_id: RequestState(ecr.request_id, i, prompt_token_ids, params,
                                               self.tokenizer, self.token_texts) for i, ecr in enumerate(ecrs)}
        rms = {ecr.request_id: RequestMetrics(self.stat_logger, len(prompt_token_ids), params, arrival, i == 0)
               for i, ecr in enumerate(ecrs)}
        req = stream.collector = _Collector(request_id, prompt_token_ids, states, rms, engine, self.stream_interval,
                                                self._ready)
        for rid in states:   # before any await: _on_dead must see it
            self._requests[rid] = req
        try:
            for ecr in ecrs:
                await self.client.add_request(ecr, engine)
            while req.unfinished:
                deltas = await req.take()
                if deltas:
                    yield req.output(deltas)
        finally:
            for rid in states:
                self._requests.pop(rid, None)
            if self.stat_logger is not None:
                self.stat_logger.use_engine(engine)   # what is recorded below is of the engine it ran on
            for rid in req.unfinished:
                rms[rid].finish("error" if self.is_dead else "abort")
            if self.stat_logger is not None and any(rm.finish_reason != "error" or rm.num_generation_tokens
                                                    for rm in rms.values()):
                self.stat_logger.record_request_done(max(rm.num_generation_tokens for rm in rms.values()))
            if req.unfinished and not self.is_dead:
                await self.client.abort(list(req.unfinished), engine)

    async def abort(self, request_id: str) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid, req in self._requests.items():
            if rid == request_id or rid.startswith(request_id + "-"):
                by_engine.setdefault(req.engine, []).append(rid)
        for engine, ids in by_engine.items():
            await self.client.abort(ids, engine)

    async def call_utility(self, method: str, *args, timeout: float | None = None) -> Any:
        """Control operation `method` on every engine core (data-parallel ranks), their answers
        merged as one as its row in ipc/control.py says."""
        return merge_results(method, await self.client.call_utility_all(method, *args, timeout=timeout))

    def close(self) -> None:
        self.client.close()
        if self.mm is not None:
            self.mm.close()


def _merge(deltas: list) -> list:
    """Several deltas of the same choice become one (a new one: a sink may refuse the merged output,
    and the deltas are then taken again)."""
    if len(deltas) == 1:   # the common case: one delta per chunk (one token per engine step)
        return deltas
    merged: dict[int, Any] = {}
    copied: set[int] = set()
    for d in deltas:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = d
            continue
        if d.index not in copied:
            copied.add(d.index)
            m = merged[d.index] = copy.copy(m)
        m.text += d.text
        m.token_ids = m.token_ids + d.token_ids
        if d.logprobs is not None:
            m.logprobs = (m.logprobs or []) + d.logprobs
            m.cumulative_logprob = d.cumulative_logprob   # a running total
        if m.prompt_logprobs is None:
            m.prompt_logprobs = d.prompt_logprobs
        m.finish_reason, m.stop_reason = d.finish_reason, d.stop_reason
    return list(merged.values())
