"""SamplingParams: how one request is sampled and when it stops.

A msgspec Struct, so it travels inside the ADD message as-is. `validate()`
raises ValueError naming the offending parameter; the API turns that into 400.
"""
from __future__ import annotations

import msgspec


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
        """(kind, value) of the one constraint given; ValueError unless exactly one is."""
        given = [(k, getattr(self, k)) for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            names = ", ".join(k for k, _ in given) or "none"
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object (got {names})")
        kind, value = given[0]
        if kind == "choice" and (not value or not all(isinstance(c, str) for c in value)):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")
        if kind in ("regex", "grammar") and not value:
            raise ValueError(f"structured_outputs {kind} must be a non-empty string")
        return kind, value


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self, max_logprobs: int = 20) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.n > 128:
            bad("n", f"must be at most 128, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= max_logprobs:
                bad(name, f"must be in [0, {max_logprobs}], got {value}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100 <= bias <= 100:
                    bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if self.structured_outputs is not None:
            self.structured_outputs.kind()
