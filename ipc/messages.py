"""Every message that crosses a process boundary, as msgspec Structs.

Structs are `array_like`: fields travel by position, so new fields are only
ever appended at the end. Frames on a socket are `[type byte, body, *buffers]`.
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec

from ipc.lora import LoRARequest
from ipc.sampling_params import SamplingParams


class MsgType(bytes, enum.Enum):
    ADD = b"\x00"          # client -> engine: EngineCoreRequest
    ABORT = b"\x01"        # client -> engine: list[str] of request ids
    UTILITY = b"\x02"      # client -> engine: UtilityRequest
    READY = b"\x03"        # engine -> client (on the input socket): EngineReady
    OUTPUTS = b"\x04"      # engine -> client: EngineCoreOutputs
    ENGINE_DEAD = b"\x05"  # engine -> client: a str reason
    HELLO = b"\x06"        # handshake (attach from elsewhere)
    WORKER_STEP = b"\x07"  # engine -> workers (ring): SchedulerOutput
    WORKER_CALL = b"\x08"  # engine -> workers (ring): WorkerCall
    WORKER_REPLY = b"\x09" # worker -> engine: WorkerReply
    ATTACH = b"\x0a"       # client -> engine (handshake socket): AttachRequest
    REFUSED = b"\x0b"      # engine -> client (handshake socket): a str reason
    REGISTER = b"\x0c"     # remote engine -> head's DP coordinator: EngineRegistration
    WORKER_SAMPLE = b"\x0d"  # engine -> workers (ring): GrammarOutput for a step whose sampling waited


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


# ---------------------------------------------------------------- client <-> engine

class MultiModalItem(_Msg):
    """One image of a request: where its placeholder tokens sit in the prompt, its content
    hash, and where its processed tensors are in the shared-memory store (never the bytes)."""
    modality: str                  # "image"
    hash: str                      # content + processor kwargs (multimodal/hasher.py)
    offset: int                    # first placeholder token in the prompt
    length: int                    # placeholder tokens = encoder output rows
    store_name: str                # shm segment (shm/object_store.py)
    store_addr: int                # entry in that segment


class EngineCoreRequest(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    client_index: int = 0
    mm_items: list[MultiModalItem] = []    # sorted by offset
    priority: int = 0                      # with --scheduling-policy priority: lower runs first
    group_id: str = ""                     # the HTTP request it came with (its n choices, its
                                           # prompts): the unit of fairness; "": its own
    lora_request: LoRARequest | None = None   # the adapter it runs with (None: the base model)


class Logprobs(_Msg):
    """Per generated token: the sampled token first, then the top-N."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]               # rank of the sampled token in the full distribution (1 = best)


class PromptLogprobs(_Msg):
    """Per prompt position p >= 1: the prompt token at p first, then the top-N."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


INTERNAL_ERROR = "internal"   # stop_reason of an error output for a failure on the server's side


class EngineCoreOutput(_Msg):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None             # with "error": why (stop_reason INTERNAL_ERROR: not the request's fault)
    pooled: bytes | None = None          # --runner pooling: the prompt's pooled vector (float32), with "stop"


class SchedulerStats(_Msg):
    """One engine step's view, for logging and metrics."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0     # tokens looked up this step
    prefix_cache_hits: int = 0        # tokens found this step
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0     # tokens in this iteration
    num_prompt_tokens: int = 0        # prefill tokens computed this step
    num_generation_tokens: int = 0
    sleep_level: int = 0
    is_paused: bool = False
    # attention work of this step, for the MFU estimates (metrics/mfu.py)
    num_attn_query_key_pairs: int = 0  # sum over scheduled tokens of the keys each attends to (causal)
    num_kv_tokens_read: int = 0       # sum over scheduled requests of their context length after this step
    # speculative decoding (vLLM's SpecDecodingStats): drafts verified, their tokens, those accepted,
    # and accepted counts by draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # with --enable-lora (vllm:lora_requests_info): requests per adapter name
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}

    def gauges_only(self) -> "SchedulerStats":
        """The state (running, waiting, KV usage, sleep, pause) without the step's counts: for the
        clients that do not count this step."""
        return SchedulerStats(self.num_running, self.num_waiting, self.kv_cache_usage,
                              sleep_level=self.sleep_level, is_paused=self.is_paused,
                              running_lora_adapters=self.running_lora_adapters,
                              waiting_lora_adapters=self.waiting_lora_adapters)


class RequestTiming(_Msg):
    """Engine-side timestamps of a finished request (seconds, time.monotonic domain of the engine)."""
    request_id: str
    queued_time: float                  # waiting before first scheduled
    prefill_time: float                 # first scheduled -> first token
    decode_time: float                  # first token -> last token
    num_prompt_tokens: int
    num_generation_tokens: int


class UtilityOutput(_Msg):
    call_id: int
    result: Any = None
    failure: str | None = None


class EngineLoad(_Msg):
    """An engine's load as one client sees it, for data-parallel routing (every client, every step)."""
    num_waiting: int
    num_running: int
    num_added: int                 # ADDs from this client the engine has taken in so far


class EngineCoreOutputs(_Msg):
    outputs: list[EngineCoreOutput] = []
    engine_index: int = 0
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    finished_timings: list[RequestTiming] = []
    load: EngineLoad | None = None


class UtilityRequest(_Msg):
    client_index: int
    call_id: int
    method: str
    args: list[Any] = []


class EngineReady(_Msg):
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    engine_index: int = 0
    model: str = ""
    client_index: int = 0          # the index the engine gave this client
    scheduling_policy: str = "fcfs"   # an attached API server checks requests' priority by the engine's


class Hello(_Msg):
    """The engine's answer to a client knocking on the handshake socket."""
    nonce: bytes                   # sign with HMAC-SHA256(auth key, nonce) when a key is required
    auth_required: bool
    model: str = ""                # no longer sent (always ""): nothing is revealed before ATTACH
    engine_public_key: bytes = b""  # z85 CURVE key the engine's sockets use towards attached clients


class AttachRequest(_Msg):
    """A client attaching from elsewhere: where the engine should connect, and its proof."""
    input_address: str
    output_address: str
    auth_proof: str = ""           # hex HMAC-SHA256(key, Hello.nonce); empty when no key is required
    client_public_key: bytes = b""  # z85 CURVE server key of the client's tcp:// sockets (required for tcp://)


class EngineRegistration(_Msg):
    """A remote engine core (`loom serve --headless --data-parallel-start-rank R`) telling the head's
    DP coordinator where its handshake socket is, after the coordinator's Hello."""
    engine_index: int
    handshake_address: str
    auth_proof: str = ""           # hex HMAC-SHA256(key, Hello.nonce)


# ---------------------------------------------------------------- engine <-> workers

class NewRequestData(_Msg):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []   # non-empty when a preempted request resumes
    seed: int = 0                      # the request's sampling seed (always set)
    eos_token_ids: list[int] = []      # min_tokens masks these
    mm_items: list[MultiModalItem] = []
    lora_request: LoRARequest | None = None   # its adapter (workers/lora/manager.py)
    # a request the workers hold (its finished ids applied, the new requests before it added) whose
    # prompt begins with this one's first shared_len tokens: prompt_token_ids holds the rest, and
    # the worker copies those from its row (engine_core/recent_prompts.py)
    shared_from: str = ""
    shared_len: int = 0


class CachedRequestData(_Msg):
    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class GrammarOutput(_Msg):
    """The grammar bitmask of one step's constrained rows: bit t of bitmask[mask_rows[j]] allows
    token t for the request at req_ids[rows[j]] (xgrammar's packed int32 layout). Rows in the same
    grammar state share a bitmask row: a step sends each distinct mask once."""
    rows: list[int]                       # indices into the step's req_ids
    bitmask: Any                          # np.ndarray int32 [distinct masks, ceil(vocab / 32)]
    mask_rows: Any = None                 # np.ndarray int32 [len(rows)]; None: row j uses bitmask[j]
    draft_pos: list[int] | None = None    # a verify step: row j's position among its request's drafts (0: first)


class KVTransfers(_Msg):
    """Copies between the GPU KV cache and its CPU tier (engine_core/kv_offload.py), made before
    the step's forward: stores (GPU block -> host slot) first, then loads (host slot -> GPU block)."""
    store_blocks: list[int]
    store_slots: list[int]
    load_slots: list[int]
    load_blocks: list[int]


class SchedulerOutput(_Msg):
    """One step, as a diff against what the workers already hold."""
    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    req_ids: list[str]                    # scheduled requests, in batch order
    num_scheduled_tokens: list[int]       # aligned with req_ids
    finished_req_ids: list[str] = []      # finished, aborted or preempted: drop their state
    step_id: int = 0
    scheduled_encoder_inputs: dict[str, list[int]] = {}   # req id -> indices of mm items to encode now
    free_encoder_hashes: list[str] = []   # encoder outputs no request needs any more
    released_mm: list[tuple[str, int]] = []   # store entries (segment, addr) of requests gone for good
    grammar: GrammarOutput | None = None  # this step's bitmask, when it was known at scheduling time
    defer_sample: bool = False            # run the model now, sample on the WORKER_SAMPLE that follows
    # req id -> the draft tokens this step verifies (speculative decoding; their slots follow the
    # request's last token in num_scheduled_tokens)
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # LOOM_SPEC_ASYNC: req id -> how many drafts the worker may place after the request's last token,
    # from its own proposals. The step was scheduled before the one in flight came back, as if that
    # one accepted every draft: the worker starts the request at its last token as it knows it, and
    # its scheduled tokens are 1 + the drafts it places (ModelRunner._place_drafts)
    spec_draft_slots: dict[str, int] = {}
    kv_transfers: KVTransfers | None = None   # CPU KV tier copies, before this step's forward


class ModelRunnerOutput(_Msg):
    req_ids: list[str]
    sampled_token_ids: list[int]          # -1 where a partial prefill sampled nothing
    # req_id -> Logprobs: the worker sets Logprobs, the engine decodes each as its encoded bytes and
    # hands them on to the client in EngineCoreOutput.logprobs unread (no lists built and re-encoded)
    logprobs: dict[str, msgspec.Raw] | None = None
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    failed: dict[str, str] | None = None  # req_id -> why: requests that failed alone (the batch went on)
    refused: dict[str, str] | None = None  # ... the same, for their own inputs (the client's error)
    # speculative decoding: req_id -> the drafts the step accepted, which come before its
    # sampled_token_ids entry (absent: none accepted); and req_id -> the next step's drafts
    spec_accepted: dict[str, list[int]] | None = None
    spec_token_ids: dict[str, list[int]] | None = None
    pooled: dict[str, bytes] | None = None  # --runner pooling: req_id -> its pooled vector (float32 bytes)
    spec_num_drafts: dict[str, int] | None = None   # req_id -> the drafts placed in its spec_draft_slots


class WorkerCall(_Msg):
    """A control call broadcast to every worker (collective RPC)."""
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    call_id: int = 0                  # echoed in the reply; 0 is never used by a call


class WorkerReply(_Msg):
    rank: int
    output: ModelRunnerOutput | None = None
    result: Any = None
    error: str | None = None
    call_id: int = 0                  # 0: a step (or start-up); else the WorkerCall it answers
