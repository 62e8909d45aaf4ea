"""SamplingParams: how one request is sampled and when it stops.

A msgspec Struct, so it travels inside the ADD message as-is. Its ranges are
checked by ipc/validation.py, at the API server and again at the engine core.
"""
from __future__ import annotations

import msgspec

from ipc.validation import ANY_MODEL, RequestError, check_sampling_params


# JSON nesting of a schema (objects and arrays; a property is two levels): xgrammar's compile time
# grows fast with it (400 nested properties took 29 s on one thread that every constrained request
# shares; 32 take 9 ms). Real schemas stay far below.
MAX_SCHEMA_DEPTH = 64
# A constraint's source (a schema's JSON, a regex, a grammar, the choices together): the engine
# compiles one grammar at a time, and compile time grows with the source (a 2.4 MB choice took
# 68 s on a 300-token vocabulary, holding up every other client's new constraints).
MAX_CONSTRAINT_CHARS = 128 * 1024


def _too_deep(schema: str | dict) -> bool:
    """Whether a schema (a dict, or its JSON text) nests deeper than MAX_SCHEMA_DEPTH."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except RecursionError:
            return True
        except msgspec.DecodeError:
            return False  # not JSON: compiling it says so
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _source_chars(kind: str, value) -> int:
    """The size of a constraint's source (its types already checked)."""
    if kind == "choice":
        return sum(map(len, value))
    if isinstance(value, dict):
        return len(msgspec.json.encode(value))
    return len(value) if isinstance(value, str) else 0


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """vLLM's constraint on the output: exactly one of these is set. The engine core compiles
    it with xgrammar; a constraint that does not compile fails the request alone."""
    json: str | dict | None = None        # a JSON schema (as a dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None            # EBNF (GBNF as xgrammar reads it)
    json_object: bool | None = None       # any JSON object
    disable_any_whitespace: bool = False  # JSON without optional whitespace

    def kind(self) -> tuple[str, object]:
        """(kind, value) of the one constraint given; ValueError unless exactly one is, or unless
        every field has its type (a Struct's constructor does not check types, and a constraint
        built from a request's JSON that the engine then could not decode would never be answered)."""
        for f in _CONSTRAINT_FIELDS:
            try:
                msgspec.convert(getattr(self, f.name), f.type)
            except msgspec.ValidationError as e:
                raise ValueError(f"structured_outputs {f.name}: {e}") from None
        given = [(k, getattr(self, k)) for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            names = ", ".join(k for k, _ in given) or "none"
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object (got {names})")
        kind, value = given[0]
        try:
            size = _source_chars(kind, value)
        except TypeError as e:   # a value JSON has no form for (msgpack's extension types decode to them)
            raise ValueError(f"structured_outputs {kind}: {e}") from None
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs {kind}: {size} characters, more than {MAX_CONSTRAINT_CHARS} "
                             "(compiling it would hold up every constrained request)")
        if kind == "json" and _too_deep(value):
            raise ValueError(f"structured_outputs json: the schema is nested more than {MAX_SCHEMA_DEPTH} levels "
                             "deep (compiling it would hold up every constrained request)")
        if kind == "choice" and (not value or not all(isinstance(c, str) for c in value)):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")
        if kind in ("regex", "grammar") and not value:
            raise ValueError(f"structured_outputs {kind} must be a non-empty string")
        return kind, value


# resolved once: msgspec.structs.fields evaluates the annotations on every call (0.2 ms, and
# kind() runs for every constrained request at the API server, the LLM and the engine core)
_CONSTRAINT_FIELDS = msgspec.structs.fields(StructuredOutputsParams)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16        # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None        # top-N per generated token (0: the sampled token alone)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] | None = None          # vLLM's: words never generated (the frontends tokenize them)
    # what the worker bans, from bad_words (frontend/processing.tokenize_bad_words) or sent as ids by
    # an engine-protocol client: a sequence's last token, once the outputs end with the rest of it
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:   # (vLLM's defaults for these, which its users pass)
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.top_k == -1:
            self.top_k = 0
        self._check_values()

    def _check_values(self) -> None:
        """The checks that need no model (ipc/validation.py, ANY_MODEL), where the params are made:
        a bad value is a ValueError here, as vLLM's SamplingParams raises one; decoded from a
        socket, msgspec reports it as a ValidationError. A value of the wrong type is left to the
        type checks (frontend/processing.typed_params; msgspec's decoders)."""
        try:
            check_sampling_params(self, ANY_MODEL)
        except RequestError:
            raise
        except Exception:   # noqa: BLE001  (a check that met a value of the wrong type)
            pass

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
