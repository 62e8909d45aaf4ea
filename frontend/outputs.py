"""What generate() returns: vLLM's RequestOutput / CompletionOutput shape."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class Logprob(msgspec.Struct, gc=False):
    """vLLM's Logprob. A Struct untracked by the garbage collector (it holds no containers):
    logprobs=N makes 1 + N of them per output token, and a dict holding only these stays
    untracked too, so a long generate() call's logprobs never make the collector's passes longer."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per token: token id -> Logprob (the sampled/prompt token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


class RequestFault(str):
    """The stop_reason of a choice that failed for its own request's reasons (a constraint its own
    bad_words or allowed_token_ids dead-end), not the server's: a 400, where other errors are 500s."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # the prompt's logprobs (entry 0 is None), on the first delta of a choice that asked for them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooled: bytes | None = None   # --runner pooling: the prompt's pooled vector (float32; frontend/pooling.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict = field(default_factory=dict)
