"""Request validation: the one place that decides whether a request can run.

Both boundaries call it: the API server (for HTTP, before any byte of a
response goes out) and the engine core (for every ADD, whoever sent it: an API
server, the offline LLM, or a client attached from elsewhere). A request that
fails gets one message, worded the same at both, naming the parameter at fault.

Integers are bounded by the types they travel in: top_k is packed as int32 and
seeds as int64 for the sampler; every token id (prompt, logit_bias,
stop_token_ids, EOS) must index the model's vocabulary, or the worker would
index out of bounds.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import msgspec

if TYPE_CHECKING:   # annotations only: SamplingParams checks its values with this module
    from ipc.sampling_params import SamplingParams

INT32_MAX = 2 ** 31 - 1
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
FLOAT32_MAX = 3.4028234663852886e38
# logits are divided or multiplied by it in float32: 1e-300 was 0 there, and made every score NaN
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4
MAX_N = 128                      # choices of one request
MAX_REQUEST_ID_CHARS = 1024      # an engine-protocol client's ids: every output of the request echoes it
MAX_STOP_STRINGS = 1024          # each output token is checked against every stop string
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024        # checked for every sampled token
MAX_EOS_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024            # entries; applied to every step of the request in the worker
MAX_ALLOWED_TOKEN_IDS = 16384     # allowed_token_ids: likewise
MAX_BAD_WORDS = 128              # bad_words strings; each is banned as written and with a leading space
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 32         # per tokenized bad word: the worker keeps each request's last 31 outputs
MAX_BAD_WORD_SEQUENCES = 2 * MAX_BAD_WORDS


class RequestError(ValueError):
    """A bad request (400 over HTTP), naming the offending parameter when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What the served model and engine allow (from EngineConfig)."""
    vocab_size: int                # 0: unknown (no vocabulary checks)
    max_model_len: int
    max_logprobs: int = 20
    priority_scheduling: bool = False

    @classmethod
    def of(cls, config) -> "Limits":
        return cls(config.vocab_size, config.max_model_len, config.max_logprobs,
                   config.scheduling_policy == "priority")


# what any model allows: SamplingParams checks its own values against these when it is built
ANY_MODEL = Limits(vocab_size=0, max_model_len=INT64_MAX, max_logprobs=INT64_MAX, priority_scheduling=True)


def _bad(param: str, why: str) -> RequestError:
    return RequestError(f"{param} {why}", param)


def _int_in(param: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise _bad(param, f"must be in [{lo}, {hi}], got {value}")


def _finite(param: str, value: float) -> None:
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise _bad(param, f"must be a finite number, got {value}")


def check_token_ids(param: str, ids, vocab_size: int) -> None:
    """Every id in [0, vocab_size)."""
    if vocab_size and ids and not _in_vocab(ids, vocab_size) and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size]   # every one, in one error (vLLM's)
        raise _bad(param, f"must be token ids in [0, {vocab_size}), got {_listed(bad)}")


@functools.lru_cache(maxsize=8)
def _ids_type(vocab_size: int):
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def _in_vocab(ids, vocab_size: int) -> bool:
    """Every id an int in [0, vocab_size), checked in one pass in C (msgspec): a 2,112-token prompt
    in 19 us, where min() and max() took 56 (the engine checks every ADD's prompt on its loop).
    False also for what only the min()/max() test can settle (bools, floats, arrays)."""
    try:
        msgspec.convert(ids, _ids_type(vocab_size))
    except Exception:   # noqa: BLE001  (a ValidationError, or a type convert does not take)
        return False
    return True


def _listed(values: list) -> str:
    """The first 50 values, and how many more."""
    shown = ", ".join(str(v) for v in values[:50])
    return shown + (f" and {len(values) - 50} more" if len(values) > 50 else "")


def check_sampling_params(p: SamplingParams, limits: Limits) -> None:
    """Everything about a request that does not depend on its prompt."""
    _int_in("n", p.n, 1, MAX_N)
    _finite("temperature", p.temperature)
    if p.temperature < 0:
        raise _bad("temperature", f"must be non-negative, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise _bad("top_p", f"must be in (0, 1], got {p.top_p}")
    if not (p.top_k in (-1, 0) or 1 <= p.top_k <= INT32_MAX):
        raise _bad("top_k", f"must be -1 or 0 (disabled) or in [1, {INT32_MAX}], got {p.top_k}")
    if not 0 <= p.min_p <= 1:
        raise _bad("min_p", f"must be in [0, 1], got {p.min_p}")
    if p.seed is not None:
        _int_in("seed", p.seed, INT64_MIN, INT64_MAX)
    if p.max_tokens is not None:
        _int_in("max_tokens", p.max_tokens, 1, INT64_MAX)
    _int_in("min_tokens", p.min_tokens, 0, limits.max_model_len)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise _bad("min_tokens", f"must not exceed max_tokens={p.max_tokens}, got {p.min_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -2 <= value <= 2:
            raise _bad(name, f"must be in [-2, 2], got {value}")
    if not MIN_REPETITION_PENALTY <= p.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise _bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                                         f"got {p.repetition_penalty}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None:
            _int_in(name, value, 0, limits.max_logprobs)
    if p.logit_bias:
        if len(p.logit_bias) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(p.logit_bias)}")
        check_token_ids("logit_bias", list(p.logit_bias), limits.vocab_size)
        out_of_range = [f"{bias} for token {tok}" for tok, bias in p.logit_bias.items() if not -100 <= bias <= 100]
        if out_of_range:
            raise _bad("logit_bias", f"values must be in [-100, 100], got {_listed(out_of_range)}")
    if p.allowed_token_ids is not None:
        if not 1 <= len(p.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
            raise _bad("allowed_token_ids",
                       f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids, got {len(p.allowed_token_ids)}")
        check_token_ids("allowed_token_ids", p.allowed_token_ids, limits.vocab_size)
    _check_bad_words(p)
    if len(p.stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(p.stop)}")
    for s in p.stop:
        if not s:
            raise _bad("stop", "must not contain empty strings")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise _bad("stop", f"strings may be at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}")
    check_token_ids("stop_token_ids", p.stop_token_ids, limits.vocab_size)
    if p.structured_outputs is not None:
        try:
            p.structured_outputs.kind()   # exactly one constraint; whether it compiles, the engine's grammar thread says
        except ValueError as e:
            raise RequestError(str(e), "structured_outputs") from None


def _check_bad_words(p: SamplingParams) -> None:
    """The strings, before a frontend tokenizes them (a bound on that work)."""
    if p.bad_words is not None:
        if len(p.bad_words) > MAX_BAD_WORDS:
            raise _bad("bad_words", f"may hold at most {MAX_BAD_WORDS} words, got {len(p.bad_words)}")
        for w in p.bad_words:
            if not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                raise _bad("bad_words", f"must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters, "
                                        f"got {w[:40]!r}")


def check_bad_words_token_ids(p: SamplingParams, limits: Limits) -> None:
    """The bad words once tokenized (an engine-protocol client sends them as bad_words_token_ids)."""
    if p.bad_words and p.bad_words_token_ids is None:
        raise _bad("bad_words", "were not tokenized: the engine protocol carries them as bad_words_token_ids")
    if p.bad_words_token_ids is None:
        return
    if len(p.bad_words_token_ids) > MAX_BAD_WORD_SEQUENCES:
        raise _bad("bad_words_token_ids", f"may hold at most {MAX_BAD_WORD_SEQUENCES} sequences, "
                                          f"got {len(p.bad_words_token_ids)}")
    for ids in p.bad_words_token_ids:
        if not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS:
            raise _bad("bad_words", f"each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens, got {len(ids)}")
        check_token_ids("bad_words_token_ids", ids, limits.vocab_size)


def check_prompt(token_ids: list[int], p: SamplingParams, limits: Limits) -> None:
    """A tokenized prompt against the vocabulary and the context length."""
    n = len(token_ids)
    if n == 0:
        raise RequestError("the prompt is empty", "prompt")
    if n >= limits.max_model_len:
        raise RequestError(f"This model's maximum context length is {limits.max_model_len} tokens. "
                           f"However, your prompt has {n} tokens (at least one more must be generated).",
                           "prompt")
    check_token_ids("prompt", token_ids, limits.vocab_size)
    if p.max_tokens is not None and n + p.max_tokens > limits.max_model_len:
        raise RequestError(f"This model's maximum context length is {limits.max_model_len} tokens. "
                           f"However, you requested {n + p.max_tokens} tokens ({n} in the prompt, "
                           f"{p.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                           "max_tokens")


def check_priority(priority: int, limits: Limits) -> None:
    if priority and not limits.priority_scheduling:   # vLLM's words
        raise RequestError(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")
    _int_in("priority", priority, INT64_MIN, INT64_MAX)


def check_eos_token_ids(eos_token_ids: list[int], limits: Limits) -> None:
    if len(eos_token_ids) > MAX_EOS_TOKEN_IDS:
        raise _bad("eos_token_ids", f"may hold at most {MAX_EOS_TOKEN_IDS} ids, got {len(eos_token_ids)}")
    check_token_ids("eos_token_ids", eos_token_ids, limits.vocab_size)


def validate_request(token_ids: list[int], p: SamplingParams, limits: Limits,
                     eos_token_ids: list[int] = (), priority: int = 0) -> None:
    """The whole check of one request; raises RequestError."""
    check_sampling_params(p, limits)
    check_prompt(token_ids, p, limits)
    check_bad_words_token_ids(p, limits)
    check_eos_token_ids(list(eos_token_ids), limits)
    check_priority(priority, limits)
