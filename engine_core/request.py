"""Request: the engine core's view of one sequence being generated."""
from __future__ import annotations

import enum
import time
import weakref

from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Holds only data (no callbacks or bound methods), so it dies with its last reference."""

    live: "weakref.WeakSet[Request]" = weakref.WeakSet()   # for leak checks

    __slots__ = ("request_id", "client_index", "prompt_token_ids", "output_token_ids",
                 "sampling_params", "eos_token_ids", "max_tokens", "seed", "status",
                 "num_computed_tokens", "num_output_placeholders", "num_cached_tokens", "stop_reason", "block_hashes",
                 "arrival_time", "priority", "first_scheduled_time", "first_token_time", "num_preemptions", "admitted_step",
                 "grammar", "spec_token_ids", "draft_slots", "prompt_logprobs_sent", "prompt_logprobs_seen",
                 "mm_items", "group", "fair_key", "lora_request", "prompt_source", "__weakref__")

    def __init__(self, req: EngineCoreRequest, max_model_len: int, seed: int):
        self.request_id = req.request_id
        self.client_index = req.client_index
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.sampling_params: SamplingParams = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        room = max_model_len - len(req.prompt_token_ids)
        mt = req.sampling_params.max_tokens
        self.max_tokens = room if mt is None else min(mt, room)
        self.seed = seed
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # tokens sampled by steps in flight, not yet received
        self.num_cached_tokens = -1      # prefix-cache hit on first scheduling (-1: not yet)
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []
        self.arrival_time = time.monotonic()
        self.priority = req.priority
        self.group = (req.client_index, req.group_id or req.request_id)   # engine_core/fairness.py
        self.fair_key = 0.0               # its place in the fcfs queue (FairShare.key_arrival)
        self.first_scheduled_time = 0.0
        self.first_token_time = 0.0
        self.num_preemptions = 0
        self.admitted_step = 0            # the step that last took it from the waiting queue
        self.mm_items = req.mm_items      # placeholder ranges, hashes, store handles (by offset)
        self.lora_request = req.lora_request   # its adapter (None: the base model)
        self.prompt_logprobs_sent = 0    # prompt positions whose logprobs went to the client
        self.prompt_logprobs_seen = 0    # ... computed since the request last (re)started
        self.grammar = None               # engine_core/structured_output.RequestGrammar when constrained
        self.spec_token_ids: list[int] = []   # draft tokens the next step verifies (vLLM's spec_token_ids)
        # the draft slots of each step in flight that samples for it, oldest first (one entry per
        # output placeholder; 0: no drafts): its rejected slots roll back when its output comes
        self.draft_slots: list[int] = []
        # (a weak reference to an earlier request, n): this prompt's first n tokens are that one's
        # (engine_core/recent_prompts.py); None: no such request was known
        self.prompt_source: tuple[weakref.ref, int] | None = None
        Request.live.add(self)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def lora_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def token_ids(self, lo: int, hi: int) -> list[int]:
        """Tokens lo..hi-1 of the prompt followed by the outputs (slices: a block's tokens are
        hashed for every request, 132 blocks of a 2,112-token prompt, so no lookup per token)."""
        n = len(self.prompt_token_ids)
        if hi <= n:
            return self.prompt_token_ids[lo:hi]
        if lo >= n:
            return self.output_token_ids[lo - n:hi - n]
        return self.prompt_token_ids[lo:] + self.output_token_ids[:hi - n]

