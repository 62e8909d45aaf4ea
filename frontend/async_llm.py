"""AsyncLLM: what an API server talks to. Tokenizer + engine client + output processing.

`generate()` yields RequestOutput deltas; if its consumer goes away (a client
disconnects and the handler is cancelled), the request is aborted in the engine.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from engine_core.client import AsyncEngineCoreClient, EngineDeadError
from engine_core.config import EngineConfig
from frontend.output_processor import RequestState
from frontend.outputs import RequestOutput
from frontend.processing import check_prompt, engine_requests, load_tokenizer
from ipc.messages import EngineCoreOutputs
from ipc.sampling_params import SamplingParams
from metrics.request_metrics import RequestMetrics

_DEAD = object()  # queue sentinel


class AsyncLLM:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str, client_index: int = 0):
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.client = AsyncEngineCoreClient(input_address, output_address, client_index,
                                            self._on_outputs, self._on_dead)
        self._queues: dict[str, asyncio.Queue] = {}
        self.stat_listeners: list = []   # callables(EngineCoreOutputs), e.g. metrics
        self.stat_logger = None          # metrics.PrometheusStatLogger: gets each request's RequestMetrics

    async def start(self, timeout: float = 900.0, engine_address: str | None = None,
                    auth_key: str | None = None) -> None:
        """Wait for the engine's READY; with engine_address, attach to that engine first."""
        if engine_address:
            await self.client.attach(engine_address, auth_key, timeout)
        else:
            await self.client.wait_ready(timeout)

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

    # ------------------------------------------------------------ outputs in

    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        now = time.monotonic()  # when these outputs reached the frontend, for latency metrics
        for out in outs.outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait((out, now))
        for listener in self.stat_listeners:
            listener(outs)

    def _on_dead(self, reason: str | None) -> None:
        for q in self._queues.values():
            q.put_nowait(_DEAD)

    # ------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        arrival = time.monotonic()
        check_prompt(self.config, prompt_token_ids, params)
        ecrs = engine_requests(request_id, prompt_token_ids, params, self.config.eos_token_ids, time.time())
        queue: asyncio.Queue = asyncio.Queue()
        states = {}
        for i, ecr in enumerate(ecrs):
            states[ecr.request_id] = RequestState(ecr.request_id, i, prompt_token_ids, ecr.sampling_params,
                                                  self.tokenizer)
            self._queues[ecr.request_id] = queue
        rms = {ecr.request_id: RequestMetrics(self.stat_logger, len(prompt_token_ids), params, arrival, i == 0)
               for i, ecr in enumerate(ecrs)}
        unfinished = set(states)
        try:
            for ecr in ecrs:
                await self.client.add_request(ecr)
            while unfinished:
                out = await queue.get()
                if out is _DEAD:
                    raise EngineDeadError(self.dead_reason)
                batch = [out]
                while not queue.empty():  # coalesce what has piled up into one delta
                    nxt = queue.get_nowait()
                    if nxt is _DEAD:
                        raise EngineDeadError(self.dead_reason)
                    batch.append(nxt)
                deltas, st = [], None
                for out, t in batch:
                    st = states[out.request_id]
                    if out.request_id not in unfinished:
                        continue
                    if out.error is not None and not st.token_ids:
                        rms[out.request_id].finish("error", t)
                        raise ValueError(out.error)
                    delta, abort = st.process(out)
                    if abort:
                        await self.client.abort([out.request_id])
                    if delta is None:
                        continue
                    rms[out.request_id].on_output(t, len(delta.token_ids), delta.finish_reason)
                    if delta.finish_reason is not None:
                        unfinished.discard(out.request_id)
                    deltas.append(delta)
                if deltas:
                    yield RequestOutput(request_id, None, prompt_token_ids, _merge(deltas),
                                        finished=not unfinished, num_cached_tokens=st.num_cached_tokens)
        finally:
            for rid in states:
                self._queues.pop(rid, None)
            for rid in unfinished:
                rms[rid].finish("error" if self.is_dead else "abort")
            if unfinished and not self.is_dead:
                await self.client.abort(list(unfinished))

    async def abort(self, request_id: str) -> None:
        ids = [rid for rid in self._queues if rid == request_id or rid.startswith(request_id + "-")]
        await self.client.abort(ids)

    async def call_utility(self, method: str, *args, timeout: float | None = None) -> Any:
        return await self.client.call_utility(method, *args, timeout=timeout)

    def close(self) -> None:
        self.client.close()


def _merge(deltas: list) -> list:
    """Several deltas of the same choice become one."""
    merged: dict[int, Any] = {}
    for d in deltas:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = d
            continue
        m.text += d.text
        m.token_ids = m.token_ids + d.token_ids
        if d.logprobs is not None:
            m.logprobs = (m.logprobs or []) + d.logprobs
        m.finish_reason, m.stop_reason = d.finish_reason, d.stop_reason
    return list(merged.values())
