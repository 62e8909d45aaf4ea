"""Incremental detokenization, O(1) per token, and stop strings.

tokenizers' DecodeStream keeps only a small window of recent ids, so each step
costs the same however long the output grows. Stop strings are searched only
in the tail that the new text could complete, and text that might still
become a stop string is held back from streaming.
"""
from __future__ import annotations

import functools

from tokenizers.decoders import ByteLevel, DecodeStream

from ipc.sampling_params import SamplingParams

_PREFIX_IDS = 6  # prompt ids fed first, so the first output token gets its spacing right


def decodes_once(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> bool:
    """Whether one decode of the whole output gives the text the stream would have given.
    A byte-level decoder's text is the UTF-8 of the tokens' bytes, so the stream's pieces
    concatenate to the whole output's decode, as long as the prompt ids that prime the stream
    end on a whole character (else the stream's first piece differs). Other decoders (e.g.
    SentencePiece's, which drops the leading space of a text's first token) stream."""
    tok = tokenizer._tokenizer
    if not isinstance(tok.decoder, ByteLevel):
        return False
    tail = tok.decode(list(prompt_token_ids[-_PREFIX_IDS:]), skip_special_tokens=skip_special_tokens)
    return not tail.endswith("\ufffd")


def _primed_stream(tok, prefix: list[int], skip_special_tokens: bool) -> DecodeStream:
    """A DecodeStream primed with the prompt's last ids. Its prefix must decode to whole
    characters: the ids after the last such cut (a character the prompt leaves unfinished) are
    stepped through it instead, held there until the output completes them. Primed with them,
    the stream's first piece carried the prompt's tail into the output text ("ul is better
    than\ufffd of ..."), where stop strings matched it too."""
    cut = len(prefix)
    while cut > 0 and tok.decode(prefix[:cut], skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        cut -= 1
    stream = DecodeStream(ids=prefix[:cut], skip_special_tokens=skip_special_tokens)
    for t in prefix[cut:]:
        stream.step(tok, t)   # (the prompt's own text: not output)
    return stream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tok = tokenizer._tokenizer  # the Rust tokenizer behind a PreTrainedTokenizerFast
        self._stream = _primed_stream(self._tok, list(prompt_token_ids[-_PREFIX_IDS:]), params.skip_special_tokens)
        self.stop = params.stop
        self._stops_by_last = _stops_by_last_char(tuple(self.stop)) if self.stop else {}
        self.include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._skip_special = params.skip_special_tokens
        self._undecoded: list[int] = []   # ids whose bytes do not yet form whole characters
        # as vLLM (its PR 22014): the text of the first min_tokens tokens is not searched for stop strings
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self.text = ""
        self._sent = 0  # chars of self.text already handed out

    def add(self, token_id: int) -> str | None:
        """Append one token. Returns the stop string if the text now contains one."""
        self._num_tokens += 1
        piece = self._stream.step(self._tok, token_id)
        if piece is None:
            self._undecoded.append(token_id)
            return None
        self._undecoded.clear()
        return self._append(piece)

    def add_unstopped(self, token_id: int) -> str:
        """add() then take_delta(False) for a request without stop strings (nothing held back):
        the token's new text, in one call."""
        self._num_tokens += 1
        piece = self._stream.step(self._tok, token_id)
        if piece is None:
            self._undecoded.append(token_id)
            return ""
        self._undecoded.clear()
        self.text += piece
        self._sent = len(self.text)
        return piece

    def flush(self) -> str | None:
        """At the end: bytes of an incomplete character decode as U+FFFD, as a full decode would."""
        if not self._undecoded:
            return None
        piece = self._tok.decode(self._undecoded, skip_special_tokens=self._skip_special)
        self._undecoded.clear()
        return self._append(piece)

    def _append(self, piece: str) -> str | None:
        if not piece:
            return None
        old = len(self.text)
        self.text += piece
        if not self.stop or 0 < self._num_tokens <= self._min_tokens:
            return None
        return self._match_stop(old, piece)

    def _match_stop(self, old: int, piece: str) -> str | None:
        """The first stop string (in the request's order) that the text contains now and did not
        before, the text cut at it. Such a match ends in the new piece: only the stop strings
        whose last character is in it are searched, each from where it could begin (with 1,024
        stop strings on every choice, a search of each per token held the API server's loop)."""
        candidates = [c for ch in set(piece) for c in self._stops_by_last.get(ch, ())]
        for _, s in sorted(candidates) if len(candidates) > 1 else candidates:
            i = self.text.find(s, max(old - len(s) + 1, 0))
            if i >= 0:
                self.text = self.text[:i + len(s) if self.include_stop else i]
                return s
        return None

    def take_delta(self, finished: bool) -> str:
        """New text since the last call, holding back a possible stop-string prefix."""
        end = len(self.text) if finished else max(len(self.text) - self._hold, self._sent)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta


@functools.lru_cache(maxsize=64)
def _stops_by_last_char(stop: tuple[str, ...]) -> dict[str, list[tuple[int, str]]]:
    """A request's stop strings by their last character, with their place in the request's
    list (shared by its choices: n detokenizers, one index)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for k, s in enumerate(stop):
        out.setdefault(s[-1], []).append((k, s))
    return out


class TokenTexts(dict):
    """token id -> tokenizer.decode([id]), the text logprobs show for a token (as vLLM), decoded
    once per id: logprobs=N names 1 + N tokens per output token. One per tokenizer (LLM, AsyncLLM).
    Where that decode is the Rust tokenizer's alone (a fast tokenizer that overrides neither
    decode nor _decode and cleans up no spaces) the Rust one is called, ~5x cheaper."""

    def __init__(self, tokenizer):
        super().__init__()
        self._decode = _rust_decode(tokenizer) or (lambda token_id: tokenizer.decode([token_id]))

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self._decode(token_id)
        return text


def _rust_decode(tokenizer):
    """decode(id) through the Rust tokenizer, or None where tokenizer.decode([id]) may differ."""
    from transformers import PreTrainedTokenizerFast
    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    rust = tokenizer._tokenizer
    return lambda token_id: rust.decode([token_id], skip_special_tokens=False)
