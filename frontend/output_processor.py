"""Turns EngineCoreOutputs into RequestOutput deltas: detokenize, stop strings, logprobs.

Shared by the offline LLM and the API servers' AsyncLLM.
"""
from __future__ import annotations

from ipc.messages import INTERNAL_ERROR, EngineCoreOutput, Logprobs, PromptLogprobs
from ipc.sampling_params import SamplingParams
from frontend.detokenizer import IncrementalDetokenizer, TokenTexts, decodes_once
from frontend.outputs import CompletionOutput, Logprob, RequestFault


class RequestState:
    """One engine request (one choice of a user request).

    final_only: the caller reads only the finished output (the offline LLM). Then a request with
    no stop strings and no logprobs is not detokenized token by token: its ids are kept and
    decoded once when it finishes, to the same text (detokenizer.decodes_once), and process()
    returns None until then. This cuts the offline client's CPU per token about 6x (the
    detokenizer's step was most of it), which matters when data-parallel engines feed one client."""

    __slots__ = ("engine_id", "index", "params", "tokenizer", "texts", "detok", "token_ids",
                 "finish_reason", "stop_reason", "num_cached_tokens", "prompt_logprobs",
                 "cumulative_logprob", "_prompt_lp_sent", "_prompt_ids")

    def __init__(self, engine_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, texts: TokenTexts, final_only: bool = False):
        self.engine_id = engine_id
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.texts = texts   # the owner's (LLM, AsyncLLM) cache of token texts, for logprobs
        self._prompt_ids = prompt_token_ids   # to replay the stream after an error (final_only)
        if (final_only and not params.stop and params.logprobs is None and params.prompt_logprobs is None
                and decodes_once(tokenizer, prompt_token_ids, params.skip_special_tokens)):
            self.detok = None
        else:
            self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        # vLLM's: the sum of the sampled tokens' logprobs, kept where they are asked for
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self._prompt_lp_sent = False

    def process(self, out: EngineCoreOutput) -> tuple[CompletionOutput | None, bool]:
        """Returns (delta or None, abort_in_engine). abort_in_engine: a stop string ended it here."""
        if out.pooled is not None:   # a pooling request: its vector, and no text (frontend/pooling.py)
            self.finish_reason, self.num_cached_tokens = "stop", out.num_cached_tokens
            return CompletionOutput(self.index, "", [], "stop", pooled=out.pooled), False
        if self.detok is None:
            return self._process_final_only(out), False
        ids = out.new_token_ids
        if (len(ids) == 1 and out.finish_reason is None and self.finish_reason is None and out.logprobs is None
                and self.cumulative_logprob is None and self.prompt_logprobs is None and not self.detok.stop):
            return self._process_one_token(ids[0], out.num_cached_tokens), False
        abort = False
        if out.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._convert(out.prompt_logprobs))
        new_ids = []
        lp_entries = self._convert(out.logprobs) if out.logprobs is not None else None
        new_lp = [] if self.params.logprobs is not None else None
        # A stop token (EOS, stop_token_ids) ends the output but is not part of its text unless
        # include_stop_str_in_output (vLLM's detokenizer does the same).
        drop_last = (out.finish_reason == "stop" and out.error is None and bool(out.new_token_ids)
                     and not self.params.include_stop_str_in_output)
        last = len(out.new_token_ids) - 1
        for j, tok in enumerate(out.new_token_ids):
            self.token_ids.append(tok)
            new_ids.append(tok)
            if new_lp is not None and lp_entries:
                new_lp.append(lp_entries[j])
                self.cumulative_logprob += out.logprobs.logprobs[j][0]
            if drop_last and j == last:
                break
            stop = self.detok.add(tok)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                abort = out.finish_reason is None
                break
        self.num_cached_tokens = out.num_cached_tokens
        if self.finish_reason is None and out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = _stop_reason(out)
        finished = self.finish_reason is not None
        if finished and self.stop_reason is None or finished and not isinstance(self.stop_reason, str):
            self.detok.flush()
        text = self.detok.take_delta(finished)
        if not new_ids and not text and not finished:
            return None, abort
        delta = CompletionOutput(self.index, text, new_ids, self.finish_reason, self.stop_reason, new_lp,
                                 self.cumulative_logprob)
        if self.prompt_logprobs is not None and not self._prompt_lp_sent:
            self._prompt_lp_sent = True   # complete by now: every prompt chunk precedes the first token
            delta.prompt_logprobs = self.prompt_logprobs
        return delta, abort

    def _process_one_token(self, token_id: int, num_cached_tokens: int) -> CompletionOutput:
        """The stream's usual step, as process() makes it: one token that no stop string, logprob or
        finish comes with (~1 us less a token at c512 than process()'s general loop)."""
        self.token_ids.append(token_id)
        self.num_cached_tokens = num_cached_tokens
        return CompletionOutput(self.index, self.detok.add_unstopped(token_id), [token_id])

    def _process_final_only(self, out: EngineCoreOutput) -> CompletionOutput | None:
        """Ids only until the end; then the whole output in one delta, as the stream would have made it."""
        self.token_ids += out.new_token_ids
        self.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is None:
            return None
        self.finish_reason = out.finish_reason
        self.stop_reason = _stop_reason(out)
        ids = self.token_ids
        if (out.finish_reason == "stop" and out.error is None and out.new_token_ids
                and not self.params.include_stop_str_in_output):
            ids = ids[:-1]   # the stop token is not part of the text (as in process())
        if out.error is None:
            text = self.tokenizer._tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        else:   # as process() does it: an error's text keeps no undecoded tail (rare: replay the stream)
            detok = IncrementalDetokenizer(self.tokenizer, self._prompt_ids, self.params)
            for tok in ids:
                detok.add(tok)
            text = detok.text
        return CompletionOutput(self.index, text, self.token_ids, self.finish_reason, self.stop_reason, None)

    def _convert(self, lp: Logprobs | PromptLogprobs) -> list[dict[int, Logprob]]:
        """Per token {id: Logprob}: the sampled (or prompt) token with its rank first, then the
        top-N with ranks 1..N (the sampled one, when among them, keeps its entry)."""
        texts = self.texts
        entries = []
        for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            tid = ids[0]
            d = {tid: Logprob(vals[0], rank, texts[tid])}
            for r in range(1, len(ids)):
                tid = ids[r]
                if tid not in d:
                    d[tid] = Logprob(vals[r], r, texts[tid])
            entries.append(d)
        return entries


def _stop_reason(out: EngineCoreOutput) -> int | str | None:
    """An ended output's stop_reason: the stop token or string, or an error's message (a
    RequestFault unless the engine said the failure was its own)."""
    if out.error is None:
        return out.stop_reason
    return out.error if out.stop_reason == INTERNAL_ERROR else RequestFault(out.error)
