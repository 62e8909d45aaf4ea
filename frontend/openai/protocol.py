"""The OpenAI-compatible wire format: request parsing and validation, and
response / stream-chunk formatting.

Pure functions and msgspec Structs; nothing here touches the engine or the
event loop, so all of it is unit-testable (tests/test_protocol.py). Requests
are decoded with strict types (a string where a number belongs is a 400 naming
the field); optional fields accept JSON null as "not given". Extra fields are
ignored, as OpenAI clients send some we do not use (user, ...). Chat messages and
their template are frontend/chat_utils.py's (shared with the offline LLM.chat).
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, NamedTuple

import msgspec

from frontend.processing import is_token_ids
from ipc.sampling_params import SamplingParams, StructuredOutputsParams
from ipc.validation import Limits, RequestError, check_priority, check_sampling_params

# ------------------------------------------------------------------ errors

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Becomes an HTTP error response in OpenAI's shape (see `error_body`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.type)


def error_body(message: str, status: int = 400, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message,
                      "type": type or _ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param,
                      "code": status}}


def model_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", 404, "model", "NotFoundError")


# ------------------------------------------------------------------ requests

class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None   # usage on every chunk (with include_usage), as vLLM


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields common to /v1/completions and /v1/chat/completions (OpenAI + vLLM's extras)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    user: str | None = None
    # vLLM's extras
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None    # "left" (default: keep the last tokens) | "right" (keep the first)
    use_beam_search: bool | None = None   # n is the beam width (frontend/openai/beam_search.py)
    length_penalty: float | None = None   # beam score = cumulative logprob / length ** length_penalty
    echo: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int | None = None      # with --scheduling-policy priority: lower runs first
    # structured outputs (frontend/openai/constraints.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None   # vLLM's: json | regex | choice | grammar | json_object
    guided_json: Any = None                           # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Any = msgspec.UNSET           # str | list[int] | list[str] | list[list[int]]; checked by hand
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Any = msgspec.UNSET         # list of {"role", "content"}; checked by hand
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    mm_processor_kwargs: dict[str, Any] | None = None   # vLLM's: e.g. {"max_pixels": 200704}
    reasoning_effort: str | None = None   # OpenAI's low | medium | high: a harmony model's (gpt-oss) system message


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None
    tools: list[Any] | None = None   # (with messages) rendered by the chat template, as a chat request's


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int] = msgspec.UNSET


_PATH_FIELD = re.compile(r"`\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def parse_request(body: bytes, cls: type[msgspec.Struct]):
    """JSON body -> request Struct, or APIError(400) naming the field at fault."""
    if not body or not body.strip():
        raise APIError("The request body is empty; expected a JSON object.", 400)
    try:
        req = msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH_FIELD.search(msg) or _MISSING_FIELD.search(msg)
        param = m.group(1) if m else None
        if param is not None:
            msg = f"Invalid value for '{param}': {msg}"
        raise APIError(msg, 400, param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # invalid UTF-8: msgspec < 0.23 raises UnicodeDecodeError with the offset inside the string
        # it was decoding, 0.23 a DecodeError without one; either way, find the bad byte in the body
        try:
            bytes(body).decode("utf-8")
        except UnicodeDecodeError as whole:
            raise APIError(f"The request body is not valid UTF-8: {whole.reason} at byte {whole.start}", 400) from None
        raise APIError(f"Invalid JSON in the request body: {e}", 400) from None
    except RecursionError:
        raise APIError("The request body is nested too deeply.", 400) from None
    for name in req.__struct_fields__:
        if getattr(req, name) is msgspec.UNSET:
            raise APIError(f"'{name}' is a required field", 400, name)
    return req


def check_model(req_model: str | None, served_name: str, also: str | None = None) -> None:
    if req_model is None or req_model == "" or req_model == served_name or (also and req_model == also):
        return
    raise model_not_found(req_model)


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: "text", [ids], ["text", ...], [[ids], ...] -> list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise _bad_prompt()
    if not prompt:
        raise APIError("'prompt' must not be empty", 400, "prompt")
    if is_token_ids(prompt):
        return [list(prompt)]
    if all(isinstance(p, str) or (isinstance(p, list) and is_token_ids(p)) for p in prompt):
        return [p if isinstance(p, str) else list(p) for p in prompt]   # a batch (strings and id lists may mix)
    raise _bad_prompt()


def _bad_prompt() -> APIError:
    return APIError("'prompt' must be a string, a list of token ids, a list of strings, or a list of token-id lists",
                    400, "prompt")


def check_stream_options(req: _SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError("Stream options can only be defined when `stream=True`.", 400, "stream_options")


def check_request_chat_template(req, trusted: bool) -> None:
    """A chat template from the request runs server-side Jinja: only with --trust-request-chat-template
    (vLLM's flag; advisory GHSA-6fvq-23cw-5628)."""
    if trusted:
        return
    if req.chat_template is not None or (req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs):
        raise APIError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                       "Refused request with untrusted chat template.", 400, "chat_template")


def build_sampling_params(req: _SamplingFields, *, chat: bool, limits: Limits,
                          defaults: dict | None = None,
                          structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """Request fields -> validated SamplingParams (APIError 400 naming the param on failure).
    `defaults` (the model's generation config, EngineConfig.default_sampling_params) fill the
    fields the client did not send; `structured` is the request's constraint (frontend/openai/constraints.py)."""
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError("best_of is not supported (it must equal n)", 400, "best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("`prompt_logprobs` are not available when `stream=True`.", 400, "prompt_logprobs")
    api = _chat_specific(req) if chat else _completion_specific(req)
    kw: dict[str, Any] = dict(
        n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, skip_special_tokens=req.skip_special_tokens)
    kw = {**(defaults or {}), **{k: v for k, v in kw.items() if v is not None}}
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    try:   # (SamplingParams checks its values as it is made)
        params = SamplingParams(max_tokens=api.max_tokens, stop=stop, logprobs=api.logprobs,
                                logit_bias=_logit_bias(req.logit_bias), prompt_logprobs=api.prompt_logprobs,
                                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None,
                                structured_outputs=structured, **kw)
        check_sampling_params(params, limits)
        check_priority(req.priority or 0, limits)
    except RequestError as e:  # named as the client sent it
        msg, param = str(e), e.param
        if param == "max_tokens":
            param = api.max_tokens_param
            msg = param + msg[len("max_tokens"):]
        elif chat and param == "logprobs":
            param = "top_logprobs"
            msg = param + msg[len("logprobs"):]
        raise APIError(msg, 400, param) from None
    return params


class _ApiSpecific(NamedTuple):
    """What the chat and the completions APIs spell differently."""
    max_tokens: int | None
    max_tokens_param: str       # the field the client set: max_tokens or max_completion_tokens
    logprobs: int | None
    prompt_logprobs: int | None


def _chat_specific(req: _SamplingFields) -> _ApiSpecific:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("when using 'top_logprobs', 'logprobs' must be set to true", 400, "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.max_completion_tokens is not None:
        return _ApiSpecific(req.max_completion_tokens, "max_completion_tokens", logprobs, req.prompt_logprobs)
    return _ApiSpecific(req.max_tokens, "max_tokens", logprobs, req.prompt_logprobs)


def _completion_specific(req: _SamplingFields) -> _ApiSpecific:
    if req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    prompt_logprobs = req.prompt_logprobs
    if req.echo:
        if prompt_logprobs is None:
            prompt_logprobs = req.logprobs      # the echoed prompt carries its logprobs (vLLM)
        if max_tokens == 0:
            max_tokens = 1                      # echo alone: score the prompt; the one token is dropped
    return _ApiSpecific(max_tokens, "max_tokens", req.logprobs, prompt_logprobs)


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """The JSON object's string keys as token ids."""
    if not bias:
        return None
    out, bad = {}, []
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except ValueError:
            bad.append(k)
    if bad:   # every one, in one error
        raise APIError(f"logit_bias keys must be token ids, got {', '.join(map(repr, bad))}", 400, "logit_bias")
    return out


def stream_usage(req: _SamplingFields) -> tuple[bool, bool]:
    """(usage chunk at the end, usage on every chunk): vLLM's include_usage / continuous_usage_stats."""
    opts = req.stream_options
    include = bool(req.stream and opts is not None and opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


# ------------------------------------------------------------------ responses

def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """cached_tokens: with --enable-prompt-tokens-details (None: no prompt_tokens_details)."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def _lp(x: float) -> float:
    # JSON has no -inf; vLLM clamps the same way
    return max(float(x), -9999.0) if x == x else -9999.0


def _tok_str(lp, tid: int, as_ids: bool = False) -> str:
    """A token as logprobs show it: its text, or "token_id:N" (return_tokens_as_token_ids)."""
    s = None if as_ids else getattr(lp, "decoded_token", None)
    return s if s is not None else f"token_id:{tid}"


def _ranked(entry: dict) -> list:
    """(token id, Logprob) sorted by rank (unknown ranks last, keeping order)."""
    items = list(entry.items())
    return sorted(items, key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)


def completion_logprobs(token_ids: list[int], entries: list, num_top: int, text_offset: int = 0,
                        as_ids: bool = False, decode=None) -> tuple[dict, int]:
    """Completions logprobs for some tokens -> (OpenAI dict, next text offset).

    top_logprobs holds the top `num_top` tokens plus the sampled one (num_top=0: the sampled one
    alone). An entry of None (the first prompt token when echoing) gives the token with a null
    logprob and null top_logprobs, as in vLLM and OpenAI; `decode(id)` names its token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            s = f"token_id:{tid}" if as_ids or decode is None else decode(tid)
            tokens.append(s)
            token_lps.append(None)
            tops.append(None)
            offsets.append(text_offset)
            text_offset += len(s)
            continue
        sampled = entry.get(tid)
        s = _tok_str(sampled, tid, as_ids)
        tokens.append(s)
        token_lps.append(_lp(sampled.logprob) if sampled is not None else None)
        top: dict[str, float] = {}
        if sampled is not None:
            top[s] = _lp(sampled.logprob)
        for other, lp in _ranked(entry):
            if other == tid or lp.rank is None or lp.rank > num_top:
                continue
            top.setdefault(_tok_str(lp, other, as_ids), _lp(lp.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, text_offset


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(tid): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for tid, lp in e.items()}
            for e in entries]


def merge_completion_logprobs(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


def _chat_tok(s: str, lp: float) -> dict:
    return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: list[int], entries: list[dict], num_top: int, as_ids: bool = False) -> dict:
    """Chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [top num_top by rank]}]}."""
    content = []
    for tid, entry in zip(token_ids, entries):
        sampled = entry.get(tid)
        item = _chat_tok(_tok_str(sampled, tid, as_ids), sampled.logprob if sampled is not None else float("-inf"))
        tops = []
        if num_top:
            for other, lp in _ranked(entry):
                if lp.rank is None or lp.rank > num_top or len(tops) >= num_top:
                    continue
                tops.append(_chat_tok(_tok_str(lp, other, as_ids), lp.logprob))
        item["top_logprobs"] = tops
        content.append(item)
    return {"content": content}


def completion_choice(index: int, text: str, finish_reason: str | None, stop_reason=None,
                      logprobs: dict | None = None, **vllm_fields) -> dict:
    """vllm_fields: vLLM's extras (prompt_logprobs, prompt_token_ids, token_ids), null when not asked for."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, **vllm_fields}


def completion_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_chunk(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None
                     ) -> dict:
    d = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        d["usage"] = usage_
    return d


def chat_choice(index: int, message: str | dict, finish_reason: str | None, stop_reason=None,
                logprobs: dict | None = None, role: str = "assistant", **vllm_fields) -> dict:
    """`message`: the assistant message (frontend/openai/chat_output.py), or just its text. vllm_fields:
    token_ids (return_token_ids)."""
    if isinstance(message, str):
        message = {"role": role, "content": message}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason, **vllm_fields}


def chat_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict, **vllm_fields) -> dict:
    """vllm_fields: prompt_logprobs, prompt_token_ids (response-level in vLLM's chat)."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, **vllm_fields}


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None = None, stop_reason=None,
                      logprobs: dict | None = None, **vllm_fields) -> dict:
    d = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **vllm_fields}
    if finish_reason is not None:
        d["stop_reason"] = stop_reason
    return d


def chat_chunk(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
               **vllm_fields) -> dict:
    d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
         **vllm_fields}
    if usage_ is not None:
        d["usage"] = usage_
    return d


def models_response(name: str, root: str, max_model_len: int, created: int | None = None,
                    quantization: str | None = None) -> dict:
    """quantization: the weights' method (vLLM's --quantization name), None when unquantized."""
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created or now(), "owned_by": "loom",
                      "root": root, "parent": None, "max_model_len": max_model_len, "permission": [],
                      "quantization": quantization}]}


_encoder = msgspec.json.Encoder()


def dumps(obj: Any) -> bytes:
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


TEXT_SLOT = "\x00loom-text-slot\x00"   # a string no chunk has: where chunk_template cuts
_TEXT_SLOT_JSON = _encoder.encode(TEXT_SLOT)
encode_json = _encoder.encode


def chunk_template(chunk: bytes) -> tuple[bytes, bytes]:
    """A chunk with TEXT_SLOT as its one text, cut around the slot's JSON: before + encode_json(text)
    + after is that chunk with `text` in the slot, byte for byte (its other fields fixed)."""
    before, slot, after = chunk.rpartition(_TEXT_SLOT_JSON)
    assert slot and _TEXT_SLOT_JSON not in before, "one text slot"
    return before, after


class ChunkFrame:
    """One stream's chunk events as bytes: the fields every chunk repeats (id, object, created,
    model) encoded once, so a chunk encodes only its choices (and usage). Byte for byte what
    sse(completion_chunk(...)) and sse(chat_chunk(...)) give (same keys, same order)."""

    __slots__ = ("head",)

    def __init__(self, rid: str, obj: str, created: int, model: str):
        head = _encoder.encode({"id": rid, "object": obj, "created": created, "model": model})
        self.head = b"data: " + head[:-1] + b',"choices":'

    def sse(self, choices: list[dict], usage_: dict | None = None) -> bytes:
        if usage_ is None:
            return self.head + _encoder.encode(choices) + b"}\n\n"
        return self.head + _encoder.encode(choices) + b',"usage":' + _encoder.encode(usage_) + b"}\n\n"
