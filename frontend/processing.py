"""Input processing shared by LLM and the API server: tokenizer loading, prompts to token ids
(one path: tokenize_prompt), and fan-out of n > 1 (the checks are ipc/validation.py's)."""
from __future__ import annotations

import uuid

import msgspec

from ipc.config import EngineConfig, check_tokenizer_files
from ipc.validation import RequestError
from ipc.lora import LoRARequest
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams


def load_tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer   # (seconds to import: the tokenizer process imports this module first)
    check_tokenizer_files(config.tokenizer_dir)
    return AutoTokenizer.from_pretrained(config.tokenizer_dir, trust_remote_code=config.trust_remote_code)


def is_token_ids(value) -> bool:
    """A list (or tuple) of ints, not bools."""
    return isinstance(value, (list, tuple)) and set(map(type, value)) <= _INT   # (not bools; the set made in C)


_INT = {int}


# A prompt of more than this many characters per token of its limit is probed before it is
# tokenized in full (encode_bounded); English runs at about 4.
_PROBE_CHARS_PER_TOKEN = 8
# At a cut before a space the prefix's pre-tokens are the whole text's, so its token count exceeds
# the whole text's by at most the last pre-token's few tokens; this much, to be safe.
_CUT_SLACK_TOKENS = 16


def encode_bounded(tokenizer, text: str, add_special_tokens: bool, limit: int | None) -> list[int]:
    """tokenizer.encode(text), except that a text which surely has more than `limit` tokens (None:
    no limit) is refused before it is tokenized in full: an 8 MiB prompt took 25 s of the
    large-input lane only to be refused as longer than the context. A prefix of
    _PROBE_CHARS_PER_TOKEN characters per token, cut before a space, is tokenized first; past
    limit + _CUT_SLACK_TOKENS tokens, the whole cannot fit. A text that passes is tokenized in full."""
    probe = (limit + _CUT_SLACK_TOKENS) * _PROBE_CHARS_PER_TOKEN if limit is not None else len(text)
    if len(text) > probe:
        cut = text.rfind(" ", probe // 2, probe)
        n = len(tokenizer.encode(text[:cut if cut > 0 else probe], add_special_tokens=add_special_tokens))
        if n > limit + _CUT_SLACK_TOKENS:
            raise RequestError(f"This model's maximum context length is {limit + 1} tokens. However, your "
                               f"prompt has more than {n - _CUT_SLACK_TOKENS} tokens (its first {probe:,} "
                               f"characters have {n}).", "prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize_prompt(tokenizer, prompt, add_special_tokens: bool = True,
                    limit: int | None = None) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt: a string, a list of token ids, or
    {"prompt_token_ids": [...]} / {"prompt": str}. The one way a prompt becomes token ids, for
    LLM.generate, the API server (/v1/completions, /tokenize) and its tokenizer process; a chat
    becomes its prompt text in frontend/chat_utils.py's render_chat. `limit`: the most tokens a
    prompt that can run may have (encode_bounded; None: any)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            if not is_token_ids(prompt["prompt_token_ids"]):
                raise RequestError("prompt_token_ids must be a list of token ids (integers)", "prompt")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt, encode_bounded(tokenizer, prompt, add_special_tokens, limit)
    if is_token_ids(prompt):
        return None, list(prompt)
    raise RequestError("a prompt must be a string or a list of token ids", "prompt")


def tokenize_prompts(tokenizer, prompts: list, add_special_tokens: bool = True,
                     limit: int | None = None) -> list[tuple[str | None, list[int]]]:
    """tokenize_prompt() of each prompt of a batch; an error names the prompt (prompt[i]) after the first."""
    out = []
    for i, p in enumerate(prompts):
        try:
            out.append(tokenize_prompt(tokenizer, p, add_special_tokens, limit))
        except RequestError as e:
            if i == 0:
                raise
            raise RequestError(f"prompt[{i}]: {e}", getattr(e, "param", "prompt")) from None
    return out


def truncate_prompt(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int,
                    side: str | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep N prompt tokens (-1: max_model_len), the last N
    (truncation_side "left", the default: the tokens dropped are the prompt's beginning) or the
    first N ("right")."""
    n = truncate_prompt_tokens
    if side not in (None, "left", "right"):
        raise RequestError(f"truncation_side must be 'left' or 'right', got {side!r}", "truncation_side")
    if n is None:
        return ids
    if n == -1:
        n = max_model_len
    if n < 0:
        raise RequestError(f"truncate_prompt_tokens must be -1 or non-negative, got {n}", "truncate_prompt_tokens")
    if n > max_model_len:
        raise RequestError(f"truncate_prompt_tokens value ({n}) is greater than max_model_len ({max_model_len}). "
                           "Please select a smaller truncation size.", "truncate_prompt_tokens")
    if side == "right":
        return ids[:n]
    return ids[-n:] if n else []   # (the whole prompt when it is shorter)


def typed_params(params) -> SamplingParams:
    """SamplingParams built in Python are not type-checked (msgspec checks only what it decodes):
    a float max_tokens or seed would pass here and fail at the engine's decoder, silently. So
    the offline LLM checks them as the HTTP and engine-protocol paths do."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}", "sampling_params")
    try:
        msgspec.convert(msgspec.to_builtins(params), SamplingParams)
    except (msgspec.ValidationError, TypeError):
        for f in msgspec.structs.fields(SamplingParams):   # which one (the struct travels as an array)
            try:
                msgspec.convert(msgspec.to_builtins(getattr(params, f.name)), f.type)
            except (msgspec.ValidationError, TypeError) as e:
                raise RequestError(f"{f.name}: {e}", f.name) from None
        # every field has its type: a value set after construction is out of range, which the
        # request's checks (ipc/validation.py) then name
    return params


def tokenize_bad_words(tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` with its bad_words as token ids, banned as vLLM bans them: each word as written
    (less leading spaces), and with one leading space (the word after another word) where
    that tokenizes to a different first token and the same length."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    seqs = []
    for word in params.bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        seqs.append(plain)
        if plain and len(spaced) == len(plain) and spaced[0] != plain[0]:
            seqs.append(spaced)
    return msgspec.structs.replace(params, bad_words_token_ids=seqs)


def engine_requests(request_id: str, token_ids: list[int], params: SamplingParams,
                    eos_token_ids: list[int], arrival_time: float, priority: int = 0,
                    group_id: str = "", lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
    """One engine request per choice; choice i of a seeded request uses seed + i. The choices
    share a fairness group (engine_core/fairness.py): `group_id`, or else the request id. Stop strings
    and bad-words strings stay with the client (its detokenizer stops; the words travel as
    token ids): n copies of up to 4 MB of them would only be encoded, sent and decoded."""
    engine_params = msgspec.structs.replace(params, stop=[], bad_words=[]) if params.stop or params.bad_words \
        else params
    if params.n == 1:
        return [EngineCoreRequest(request_id, token_ids, engine_params, eos_token_ids, arrival_time,
                                  priority=priority, group_id=group_id, lora_request=lora_request)]
    reqs = []
    for i in range(params.n):
        p = msgspec.structs.replace(engine_params, n=1)
        if params.seed is not None:  # wrapped into int64, where seeds travel (2**63 - 1 + 1 -> -2**63)
            p.seed = (params.seed + i + 2 ** 63) % 2 ** 64 - 2 ** 63
        reqs.append(EngineCoreRequest(f"{request_id}-{i}", token_ids, p, eos_token_ids, arrival_time,
                                      priority=priority, group_id=group_id or request_id, lora_request=lora_request))
    return reqs


def new_request_id(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex
