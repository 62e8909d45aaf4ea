"""The frontend's timeline of one engine request (one choice of a user request).

AsyncLLM.generate() makes one per choice at arrival and updates it with every
output it turns into a delta; the sink (the process's PrometheusStatLogger, or
None for no metrics) is told as things happen:

    first token    prompt tokens counted, time to first token observed
    each output    generation tokens counted (the tokens delivered), inter-token latency
                   observed for every output after the first
    finish         finish reason, e2e latency, per-request histograms

The prompt tokens of a request are counted exactly once: at its first token,
or at its finish when it produced none (aborted in the queue), but never for
a request the engine rejected ("error" without output). Times are
time.monotonic() seconds of the API-server process.
"""
from __future__ import annotations

import time


class RequestMetrics:
    __slots__ = ("sink", "num_prompt_tokens", "num_cached_tokens", "max_tokens", "n", "is_first_choice", "arrival_time",
                 "first_token_time", "last_token_time", "num_generation_tokens", "prompt_counted",
                 "finish_reason", "finish_time")

    def __init__(self, sink, num_prompt_tokens: int, params, arrival_time: float | None = None,
                 is_first_choice: bool = True):
        self.sink = sink
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0           # prefix-cache hits, as the engine reports them
        self.max_tokens: int | None = getattr(params, "max_tokens", None)
        self.n: int = getattr(params, "n", 1) or 1
        self.is_first_choice = is_first_choice   # the one that reports the user request's n / max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.num_generation_tokens = 0
        self.prompt_counted = False
        self.finish_reason: str | None = None
        self.finish_time = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_output(self, now: float, num_new_tokens: int, finish_reason: str | None = None) -> None:
        """One engine output, as it reached the frontend (`now`), with the tokens it delivered."""
        if self.finished:
            return
        if num_new_tokens > 0:
            ttft = itl = None
            if not self.first_token_time:
                self.first_token_time = now
                ttft = now - self.arrival_time
                self._count_prompt()
            else:
                itl = now - self.last_token_time
            self.last_token_time = now
            self.num_generation_tokens += num_new_tokens
            if self.sink is not None:
                self.sink.record_tokens(num_new_tokens, ttft, itl)
        if finish_reason is not None:
            self.finish(finish_reason, now)

    def finish(self, reason: str, now: float | None = None) -> None:
        """Idempotent: only the first call counts."""
        if self.finished:
            return
        self.finish_reason = reason
        self.finish_time = time.monotonic() if now is None else now
        if reason != "error" or self.num_generation_tokens:
            self._count_prompt()
        if self.sink is not None:
            self.sink.record_finished(self)

    def _count_prompt(self) -> None:
        if not self.prompt_counted:
            self.prompt_counted = True
            if self.sink is not None:
                self.sink.record_prompt_tokens(self.num_prompt_tokens, self.num_cached_tokens)

    # ------------------------------------------------------------ derived

    @property
    def e2e_latency(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float:
        """Mean time between tokens after the first (0 with fewer than two), like vLLM's."""
        if self.num_generation_tokens < 2:
            return 0.0
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)
