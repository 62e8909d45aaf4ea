"""StructuredOutputManager: the grammars of constrained requests (vLLM's v1/structured_output).

A constrained request's grammar is compiled with xgrammar on a thread pool, never on the
busy loop, and cached by its source; the request waits in the scheduler until it is ready
(or finishes with an error if it does not compile), while the others keep stepping. The
manager keeps one GrammarMatcher per request, advances it with every accepted token, and
packs each step's bitmask (xgrammar's int32 layout) for the constrained rows only, on a thread
of its own (xgrammar's batch fill, its threads at the busy loop's priority) while the loop
schedules the next step.

With a reasoning parser, a request's grammar applies only once its thinking has ended
(the output ends with the parser's end-of-thinking tokens, e.g. `</think>`).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from ipc.config import EngineConfig
from ipc.messages import GrammarOutput, SchedulerOutput
from ipc.grammar import REASONING_END, REASONING_START, compile_grammar, grammar_key, prompt_ended_thinking

logger = logging.getLogger(__name__)
GRAMMAR_THREAD_NICE = 19   # relative to the engine core, capped at 19 (see _yield_cpu)

_CACHE_SIZE = 1024


class RequestGrammar:
    """One request's grammar: compiling (`future`), then its matcher."""
    __slots__ = ("future", "matcher", "active", "error", "ahead")

    def __init__(self, future: Future, active: bool):
        self.future = future
        self.matcher = None
        self.active = active        # False while the model is still thinking
        self.error: str | None = None
        self.ahead: bool | None = None   # the verdict of a token accepted ahead of the scheduler's update


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, wake: Callable[[], None] | None = None):
        self.config = config
        self.wake = wake or (lambda: None)   # tells the busy loop that a grammar is ready
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Future | None = None
        self._grammars: OrderedDict[tuple[str, str], Future] = OrderedDict()
        # the step's bitmask fill: its own thread, started from the busy loop's and so at its priority
        # (xgrammar's BatchGrammarMatcher starts its threads as it is made: made on the compile
        # pool's nice-19 thread, they filled every step's bitmask at nice 19, starved by the busy
        # processes of a loaded host, and the fill bounded the step)
        self._filler: ThreadPoolExecutor | None = None
        self._batch = None                   # xgrammar.BatchGrammarMatcher, made on the filler thread
        self._masks: list[np.ndarray] = []   # the fills' two bitmask buffers, taken in turn (_mask_buffer)
        self._turn = 0
        self.vocab_size = 0
        self.activated = False   # a grammar began to apply (its thinking ended) since the flag was cleared
        self._think_start: list[int] = []
        self._think_end: list[int] = []

    # ------------------------------------------------------------ compiling (on the pool)

    def _start(self) -> None:
        """The first constrained request loads the tokenizer and xgrammar (as vLLM does: lazily)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="loom-grammar", initializer=_yield_cpu)
            self._compiler = self._pool.submit(self._make_compiler)

    def _make_compiler(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_dir,
                                                  trust_remote_code=self.config.trust_remote_code)
        self.vocab_size = max(self.config.vocab_size or 0, len(tokenizer))   # the model's (padded) vocabulary
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        parser = self.config.reasoning_parser
        if parser:
            self._think_start = tokenizer.encode(REASONING_START[parser], add_special_tokens=False)
            self._think_end = tokenizer.encode(REASONING_END[parser], add_special_tokens=False)
        return xgr.GrammarCompiler(info, max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))

    def _compile(self, key: tuple[str, str]):
        try:
            return compile_grammar(self._compiler.result(), *key)
        finally:
            self.wake()

    def add_request(self, req) -> None:
        """Start compiling `req`'s grammar (or take it from the cache)."""
        params = req.sampling_params.structured_outputs
        if params is None:
            return
        self._start()
        try:
            key = grammar_key(params)
        except (ValueError, TypeError) as e:
            future: Future = Future()
            future.set_exception(ValueError(f"structured_outputs: {e}"))
        else:
            future = self._grammars.get(key)
            if future is None:
                future = self._pool.submit(self._compile, key)
                self._grammars[key] = future
                if len(self._grammars) > _CACHE_SIZE:
                    self._grammars.popitem(last=False)
            else:
                self._grammars.move_to_end(key)
        req.grammar = RequestGrammar(future, active=not self.config.reasoning_parser)

    def ready(self, req) -> bool:
        """Whether `req` may be scheduled: unconstrained, or its grammar compiled (or failed:
        then req.grammar.error says why and the scheduler fails it)."""
        g = req.grammar
        if g is None or g.matcher is not None or g.error is not None:
            return True
        if not g.future.done():
            return False
        try:
            import xgrammar as xgr
            g.matcher = xgr.GrammarMatcher(g.future.result(), override_stop_tokens=list(req.eos_token_ids) or None)
        except Exception as e:  # noqa: BLE001  (the request fails alone)
            g.error = str(e)
            # the cached future re-raises this same object for every request with that constraint,
            # and each raise chains this frame (which holds req) onto its traceback: drop it
            e.__traceback__ = None
            return True
        if not g.active:
            g.active = self._thinking_ended(req.prompt_token_ids, in_prompt=True)
        for tok in req.output_token_ids:   # a preempted request that resumes
            self.accept(req, tok)
        return True

    # ------------------------------------------------------------ per token and per step

    def accept(self, req, token: int) -> bool:
        """Advance req's matcher with an accepted token (req's output ends with it); True when its
        grammar has ended. A token accepted ahead (accept_ahead) gives its verdict here."""
        g = req.grammar
        if g.ahead is not None:
            ended, g.ahead = g.ahead, None
            return ended
        if not g.active:
            g.active = self._thinking_ended(req.output_token_ids, in_prompt=False)
            self.activated |= g.active
            return False
        return self._advance(req, token, len(req.output_token_ids) - 1)

    def can_accept_ahead(self, req) -> bool:
        g = req.grammar
        return g is not None and g.active and g.matcher is not None and g.error is None and g.ahead is None

    def accept_ahead(self, req, token: int) -> None:
        """Advance req's matcher with its next output token before the scheduler appends it, so
        that the next step's bitmask fill starts at once (EngineCore._take_oldest); the scheduler's
        accept() then takes the verdict. Only for a request can_accept_ahead() allows."""
        req.grammar.ahead = self._advance(req, token, len(req.output_token_ids))

    def _advance(self, req, token: int, num_before: int) -> bool:
        g = req.grammar
        if not g.matcher.accept_token(token):
            # a token the bitmask did not allow: every token was masked (a schema that admits
            # nothing, or allowed_token_ids outside the grammar); the request fails alone
            logger.warning("request %s: token %d rejected by its grammar", req.request_id, token)
            g.error = f"the constraint admits no token after {num_before} output tokens " \
                      "(with this request's allowed_token_ids, bad_words and min_tokens)"
            return True
        return g.matcher.is_terminated()

    def _thinking_ended(self, ids: list[int], in_prompt: bool) -> bool:
        end, start = self._think_end, self._think_start
        if not end:
            return True
        if not in_prompt:
            return len(ids) >= len(end) and ids[-len(end):] == end
        return prompt_ended_thinking(ids, start, end)

    def valid_prefix(self, req, drafts: list[int]) -> list[int]:
        """The longest prefix of req's drafts its grammar accepts (the matcher rolled back after):
        drafts past a token the grammar refuses could never be accepted. None while thinking."""
        g = req.grammar
        if g.matcher is None or not g.active or g.matcher.is_terminated():
            return []
        n = 0
        for tok in drafts:
            if not g.matcher.accept_token(tok):
                break
            n += 1
            if g.matcher.is_terminated():
                break
        if n:
            g.matcher.rollback(n)
        return drafts[:n]

    def _spec_bitmask(self, so: SchedulerOutput, requests: dict) -> GrammarOutput | None:
        """A verify step's bitmask: each constrained request's row before each of its drafts and
        after the last (the matcher advanced through the drafts, then rolled back)."""
        rows, pos, masks = [], [], []
        words = (self.vocab_size + 31) // 32
        for i, rid in enumerate(so.req_ids):
            req = requests.get(rid)
            g = req.grammar if req is not None else None
            if g is None or not g.active or g.matcher is None or g.matcher.is_terminated():
                continue
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            n = 0
            for j in range(len(drafts) + 1):
                mask = np.empty((1, words), dtype=np.int32)
                g.matcher.fill_next_token_bitmask(mask, 0)
                rows.append(i)
                pos.append(j)
                masks.append(mask)
                if j == len(drafts) or not g.matcher.accept_token(drafts[j]):
                    break
                n += 1
                if g.matcher.is_terminated():
                    break
            if n:
                g.matcher.rollback(n)
        if not rows:
            return None
        return GrammarOutput(rows, np.concatenate(masks), None, pos)

    def grammar_bitmask(self, so: SchedulerOutput, requests: dict) -> GrammarOutput | None:
        """The bitmask of `so`'s constrained rows whose grammar applies, from their matchers' state
        now (every earlier token accepted)."""
        if so.scheduled_spec_decode_tokens:
            return self._spec_bitmask(so, requests)
        return self.start_grammar_bitmask(so, requests).result()

    def start_grammar_bitmask(self, so: SchedulerOutput, requests: dict) -> Future:
        """grammar_bitmask() filled on the filler thread (xgrammar releases the GIL, and fills the
        rows on its own threads): a Future of it, so that the busy loop schedules the next step
        meanwhile. The matchers must not advance until it is done. (A step with drafts to
        verify fills its per-position rows here, synchronously.)"""
        if so.scheduled_spec_decode_tokens:
            done: Future = Future()
            done.set_result(self._spec_bitmask(so, requests))
            return done
        rows, matchers = [], []
        for i, rid in enumerate(so.req_ids):
            req = requests.get(rid)
            g = req.grammar if req is not None else None
            if g is not None and g.active and g.matcher is not None and not g.matcher.is_terminated():
                rows.append(i)
                matchers.append(g.matcher)
        if not rows:
            done: Future = Future()
            done.set_result(None)
            return done
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="loom-bitmask")
        return self._filler.submit(self._fill, rows, matchers)

    def _fill(self, rows: list[int], matchers: list) -> GrammarOutput:
        bitmask = self._mask_buffer(len(rows))
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            if self._batch is None:
                import xgrammar as xgr
                self._batch = xgr.BatchGrammarMatcher(max(1, min(8, (os.cpu_count() or 2) // 2)))
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return GrammarOutput(rows, *_distinct_rows(bitmask))

    def _mask_buffer(self, n: int) -> np.ndarray:
        """[n, words] int32 rows to fill: a fresh array of 256 x 152k-token rows (4.9 MB) costs
        ~0.6 ms of page faults a step on the fill's critical path, so two buffers are kept and
        taken in turn. Each fill's mask is encoded and sent (executor.sample) before the next
        fill starts, so the one before is never overwritten while in use."""
        words = (self.vocab_size + 31) // 32
        if not self._masks or len(self._masks[0]) < n:
            self._masks = [np.empty((max(n, self.config.max_num_seqs), words), dtype=np.int32) for _ in range(2)]
        self._turn ^= 1
        return self._masks[self._turn][:n]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._filler is not None:
            self._filler.shutdown(wait=False, cancel_futures=True)


def _yield_cpu() -> None:
    """Run this thread (the grammar pool's: it makes the compiler) at the lowest priority, nice
    19. xgrammar releases the GIL while it compiles, so the busy loop never waits for the GIL;
    but its threads (started from this one, so they inherit the priority) compete with the loop
    for cores, and a core-starved loop steps slower while a schema compiles. At nice 19 the loop
    gets ~98% of a contended core, yet a compile still progresses on a box whose cores are all
    busy (SCHED_IDLE, tried first, starved compiles there until the load ended; nice 10 left
    the free batch's steps +5% slower on the H200 host while 8 schemas compiled)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + GRAMMAR_THREAD_NICE))
    except (AttributeError, OSError):   # not Linux, or not allowed
        pass


def _distinct_rows(bitmask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(distinct rows, which of them each row is): requests in the same grammar state (inside a
    JSON string, say) share one row, so a step of 256 such requests sends ~1 row, not 5 MB.
    Rows are told apart by a 64-bit key each (_row_keys), then checked whole: rows whose keys
    collide but differ send every row."""
    if len(bitmask) < 8:
        return bitmask, None
    _, first, which = np.unique(_row_keys(bitmask), return_index=True, return_inverse=True)
    if len(first) == len(bitmask):   # (no whole-mask compare: ~1.1 ms for 256 rows)
        return bitmask, None
    distinct = bitmask[first]
    if not np.array_equal(distinct[which], bitmask):
        return bitmask, None
    return distinct, which.astype(np.int32)


def _row_keys(bitmask: np.ndarray) -> np.ndarray:
    """Per row, the sum of its words as 64-bit integers (mod 2^64: two rows that differ in one
    word differ here; 0.06 ms for 256 x 4,748 words) plus a position-weighted hash of a sample
    of its words (a sum is blind to words swapped). A sample alone was not enough: masks of
    different states often differ only outside it, and each such step paid the whole compare."""
    words = bitmask.shape[1]
    whole = (bitmask.view(np.uint64) if words % 2 == 0 else bitmask.view(np.uint32)).sum(axis=1, dtype=np.uint64)
    sample = bitmask[:, ::37].view(np.uint32).astype(np.uint64)
    weights = (np.arange(1, sample.shape[1] + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    return whole ^ (sample * weights).sum(axis=1, dtype=np.uint64)
