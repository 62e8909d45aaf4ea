"""Scheduler: continuous batching with one token budget per step.

Running requests are served first (decodes and unfinished prompt chunks),
then waiting ones; a long prompt is prefilled in chunks across steps. When KV
blocks run out, the newest running request is preempted (its blocks freed, to
be recomputed) and returns to the front of the queue. Under
--scheduling-policy priority (vLLM's), both the queue and the running list are
ordered by each request's (priority, arrival): the running requests are served
in that order, and preemption takes the last of them. Under fcfs, the requests of one HTTP
request share one fair share of the queue and the batch (engine_core/fairness.py).
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from ipc import envs
from ipc.config import EngineConfig
from engine_core.encoder_cache_manager import EncoderCacheManager, EncoderFit
from engine_core.fairness import FairShare
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.structured_output import StructuredOutputManager
from ipc.messages import (INTERNAL_ERROR, CachedRequestData, EngineCoreOutput, GrammarOutput, Logprobs, ModelRunnerOutput,
                          NewRequestData, PromptLogprobs, RequestTiming, SchedulerOutput, SchedulerStats)


@dataclass
class _StepPlan:
    """What one schedule() call has decided so far."""
    token_budget: int
    encoder_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)   # req id -> tokens, in batch order
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    preempted: list[Request] = field(default_factory=list)
    encode: dict[str, list[int]] = field(default_factory=dict)    # req id -> mm items to encode
    spec: dict[str, list[int]] = field(default_factory=dict)      # req id -> draft tokens to verify
    draft_slots: dict[str, int] = field(default_factory=dict)     # req id -> draft slots the worker fills


def _first_logprobs(raw, n: int):
    """The first n tokens' rows of an encoded Logprobs (a request stopped inside its accepted drafts)."""
    import msgspec
    lp = msgspec.msgpack.decode(raw, type=Logprobs) if isinstance(raw, msgspec.Raw) else raw
    return Logprobs(lp.token_ids[:n], lp.logprobs[:n], lp.ranks[:n])


def _count_loras(reqs) -> dict[str, int]:
    """Requests per adapter name."""
    out: dict[str, int] = {}
    for r in reqs:
        if r.lora_request is not None:
            out[r.lora_request.lora_name] = out.get(r.lora_request.lora_name, 0) + 1
    return out


def _may_draft(req: Request) -> bool:
    """Whether the worker drafts for req (workers/spec_decode may_speculate): not with penalties
    or bad words, which depend on the outputs before each draft position."""
    params = req.sampling_params
    return not params.needs_penalties and not params.bad_words_token_ids


def _priority_order(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


def _fair_order(req: Request) -> float:
    return req.fair_key


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, structured: StructuredOutputManager | None = None,
                 kv_window: int | None = None):
        """kv_window: the sliding window every request's KV blocks are trimmed to (None: keep all)."""
        self.config = config
        self.structured = structured or StructuredOutputManager(config)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, kv_window)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.by_priority = config.scheduling_policy == "priority"
        self.fair = FairShare(config.max_num_seqs)
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []   # to tell workers at the next step
        self.step_id = 0
        self._stats = SchedulerStats()
        self._timings: list[tuple[int, RequestTiming]] = []   # (client_index, timing)
        self._unfittable: list[Request] = []     # failed at scheduling; reported with the next outputs
        budget = config.mm_encoder_budget
        self.encoder = EncoderCacheManager(budget, 2 * budget)
        self.released_mm: list[tuple[str, int]] = []   # store entries of requests gone for good
        self.spec = config.speculative
        # a draft model (or EAGLE head) writes its KV k - 1 slots past the verified ones: they are allocated with the step's
        self.num_lookahead = (self.spec.num_speculative_tokens
                              if self.spec and self.spec.method in ("draft_model", "eagle", "eagle3") else 0)
        # LOOM_SPEC_ASYNC: a decoding request's next step is scheduled while its verify step runs, with
        # draft slots the worker fills (_draft_slots). Not with a sliding-window trim, which would free
        # blocks behind the optimistic position that the step's true one still reads.
        self.spec_async = self.spec is not None and envs.LOOM_SPEC_ASYNC and kv_window is None

    # ------------------------------------------------------------ requests in and out

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.structured.add_request(req)
        self._enqueue(req, front=False)

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: in (priority, arrival) order under the priority policy, else in
        fair order (engine_core/fairness.py), or at the front (a preempted request)."""
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_priority_order)
        elif front:
            if self.waiting:   # (the queue stays sorted by key)
                req.fair_key = min(req.fair_key, self.waiting[0].fair_key)
            self.waiting.appendleft(req)
        else:
            self.fair.key_arrival(req)
            if not self.waiting or req.fair_key >= self.waiting[-1].fair_key:
                self.waiting.append(req)
            else:
                bisect.insort(self.waiting, req, key=_fair_order)

    def finish_requests(self, req_ids, status: RequestStatus) -> list[Request]:
        """End requests from outside (abort); returns those that were still alive."""
        done = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req, status)
            done.append(req)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_releases(self) -> bool:
        """Whether a step should go out even with nothing to run: freed store entries or encoder
        outputs that the workers must drop."""
        return bool(self.released_mm or self.encoder.to_free)

    def release_mm(self, items) -> None:
        """The workers drop their store references with the next step (whether or not the
        request ever ran), so the API server's store can reuse the room."""
        self.released_mm.extend((it.store_name, it.store_addr) for it in items)

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self.encoder.drop_request(req)
        self.release_mm(req.mm_items)
        del self.requests[req.request_id]
        self.finished_req_ids.append(req.request_id)
        if req.first_token_time:
            now = time.monotonic()
            self._timings.append((req.client_index, RequestTiming(
                req.request_id, req.first_scheduled_time - req.arrival_time,
                req.first_token_time - req.first_scheduled_time, now - req.first_token_time,
                req.num_prompt_tokens, len(req.output_token_ids))))

    # ------------------------------------------------------------ one step

    def schedule(self, allow_new: bool = True) -> SchedulerOutput:
        """The next step: running requests first, then (unless one was preempted) waiting ones,
        within one token budget. Counters advance now, so the step after can be scheduled before
        this one's tokens are back."""
        plan = _StepPlan(self.config.max_num_batched_tokens, self.encoder.budget)
        self._schedule_running(plan)
        if allow_new and not plan.preempted:   # none join in a step that preempted
            self._schedule_waiting(plan)
        # a constrained request with a token in flight: its bitmask needs that token first
        defer_sample = any(self.requests[rid].grammar is not None and self.requests[rid].num_output_placeholders
                           for rid in plan.num_scheduled)
        self._advance(plan)
        return self._step_output(plan, defer_sample)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Decodes and unfinished prompt chunks, oldest (or first by priority) first; when KV
        blocks run out, the running requests at the list's end are preempted to make room."""
        i = 0
        while i < len(self.running) and plan.token_budget > 0:
            req = self.running[i]
            i += 1
            pending = self._pending_drafts(req)
            n = min(req.num_tokens + req.num_output_placeholders + pending - req.num_computed_tokens,
                    plan.token_budget)
            n = self._prompt_chunk(req, req.num_computed_tokens, n)
            if n > 0 and req.mm_items:
                fit = self.encoder.fit(req, req.num_computed_tokens, n, plan.encoder_budget)
                n = fit.n
            if n <= 0 or self._at_limit(req, pending):  # waiting for its in-flight token, or those may end it
                continue
            slots = self._draft_slots(req, pending, plan.token_budget)
            drafts = self._drafts(req, n, plan.token_budget) if slots is None else []
            n += len(drafts) + (slots or 0)
            while (new_blocks := self.kv.allocate_slots(req, n + self._lookahead(req.num_computed_tokens + n))) is None:
                victim = self.running.pop()   # after req in the list: not scheduled in this step
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                return  # req preempted itself: nothing below it is left either
            if req.mm_items:
                self._commit_encoder(req, fit, plan)
            plan.num_scheduled[req.request_id] = n
            plan.token_budget -= n
            if drafts:
                plan.spec[req.request_id] = drafts
            if slots is not None:
                plan.draft_slots[req.request_id] = slots
            plan.cached.req_ids.append(req.request_id)
            plan.cached.new_block_ids.append([b.block_id for b in new_blocks])
            plan.cached.num_computed_tokens.append(req.num_computed_tokens)

    def _prompt_chunk(self, req: Request, start: int, n: int) -> int:
        """n tokens from `start`, or one where the request is in a short prompt (at most
        config.stepwise_prompt_tokens: Whisper's decoder prompt) and others run beside it: the
        step stays all one-token rows, which a decode graph replays (a prompt chunk would make it
        an eager step, whose launches cost more host time than the step's device time)."""
        limit = self.config.stepwise_prompt_tokens
        if n <= 1 or not limit or not start < req.num_prompt_tokens <= limit:
            return n
        others = len(self.running) - (req.status == RequestStatus.RUNNING)
        return 1 if others > 0 else n

    def speculating(self) -> bool:
        """Whether drafts are verified now: speculation on, and fewer than disable_by_batch_size
        requests running."""
        limit = self.spec.disable_by_batch_size if self.spec is not None else None
        return self.spec is not None and (limit is None or len(self.running) < limit)

    def awaits_verification(self) -> bool:
        """Whether the next step should verify drafts: speculating, and a running request holds
        drafts. The engine core then keeps one step in flight (a request's drafts follow its last
        output); while no proposal comes (n-gram finding no match) steps overlap as usual. Under
        LOOM_SPEC_ASYNC only a constrained request holds drafts here (the others' stay in the worker)."""
        return self.speculating() and any(r.spec_token_ids for r in self.running)

    def _lookahead(self, end: int) -> int:
        """Slots past a step's last token that a draft model writes (none past max_model_len)."""
        return max(0, min(self.num_lookahead, self.config.max_model_len - end))

    def _pending_drafts(self, req: Request) -> int:
        """LOOM_SPEC_ASYNC: the draft slots of req's steps in flight, which the scheduler counts as
        computed (as if all were accepted) until their outputs say how many were."""
        return sum(req.draft_slots) if self.spec_async and req.grammar is None else 0

    def _draft_slots(self, req: Request, pending: int, budget: int) -> int | None:
        """LOOM_SPEC_ASYNC: how many drafts a decoding request's next step may verify, to be filled
        by the worker with its own (ModelRunner._place_drafts). The step is scheduled before the
        step in flight comes back: before its drafts exist, and before it is known how many of its
        own it accepts, so the scheduler places it as if every one is accepted (the KV blocks of the
        longest case, the room left by the most tokens it could give) and the worker moves it back
        to where the request's last token is. None: a step the scheduler plans itself (a prompt
        chunk; a constrained request, whose drafts its grammar cuts here; no drafts in flight and
        none to verify)."""
        if (not self.spec_async or req.grammar is not None or req.num_computed_tokens < req.num_prompt_tokens
                or req.num_computed_tokens + 1 != req.num_tokens + req.num_output_placeholders + pending):
            return None
        slots = 0
        if self.speculating() and _may_draft(req):
            in_flight = req.num_output_placeholders + pending   # the most tokens the steps in flight give
            slots = max(0, min(self.spec.num_speculative_tokens, budget - 1,
                               req.max_tokens - len(req.output_token_ids) - in_flight - 1,
                               self.config.max_model_len - req.num_computed_tokens - 2))
        return slots if slots or pending else None

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The draft tokens a decoding request verifies in this step after its one new token: its
        spec_token_ids, cut to the budget, to the tokens it may still produce and to what its
        grammar accepts; none while disable_by_batch_size or more requests run."""
        drafts = req.spec_token_ids
        if not drafts or n != 1 or req.num_output_placeholders or req.num_computed_tokens != req.num_tokens - 1:
            return []   # (kept: awaits_verification() holds the next step back until a step's output replaces them)
        if not self.speculating():
            return []
        req.spec_token_ids = []
        room = min(budget - 1, req.max_tokens - len(req.output_token_ids) - 1,
                   self.config.max_model_len - req.num_tokens - 1)
        drafts = drafts[:max(room, 0)]
        if drafts and req.grammar is not None:
            drafts = self.structured.valid_prefix(req, drafts)
        return drafts

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Waiting requests, oldest (or just preempted) first, while blocks and budget last. One
        whose grammar is still compiling, or whose group holds its share of the batch
        (engine_core/fairness.py), keeps its place; the others go past it."""
        passed: list[Request] = []
        counts = None if self.by_priority or not self.waiting else self.fair.running_counts(self.running)
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.structured.ready(req) or self.fair.at_cap(req, counts) or not self._lora_fits(req):
                passed.append(self.waiting.popleft())
                if len(passed) > self.config.max_num_seqs:
                    break   # (bounded work per step: a fan-out's queued rest all wait alike)
                continue
            if req.grammar is not None and req.grammar.error is not None:
                self._fail_waiting(req, req.grammar.error)
                continue
            hits = self.kv.get_computed_blocks(req)
            num_hit = len(hits) * self.config.block_size
            n = self._prompt_chunk(req, num_hit, min(req.num_tokens - num_hit, plan.token_budget))
            if req.mm_items:
                fit = self.encoder.fit(req, num_hit, n, plan.encoder_budget)
                n = fit.n
                if n <= 0:
                    break  # its next image cannot be encoded in this step
            if self.kv.allocate_slots(req, n + self._lookahead(num_hit + n), hits) is None:
                if not self.running:
                    self._fail_unfittable(req)
                    continue
                break
            self.waiting.popleft()
            if req.mm_items:
                self._commit_encoder(req, fit, plan)
            self._admit(req, num_hit, n, plan)
            if not self.by_priority:
                self.fair.admitted(req)
                if counts is not None:   # (req joined the running requests: its group's count, not a recount)
                    counts[req.group] += 1
                else:
                    counts = self.fair.running_counts(self.running)
        self.waiting.extendleft(reversed(passed))

    def _lora_fits(self, req: Request) -> bool:
        """Whether req's adapter fits the GPU slots (--max-loras) beside the running requests':
        the base model, an adapter already running, or one more while a slot is left."""
        if not req.lora_id:
            return True
        running = {r.lora_id for r in self.running} - {0}
        return req.lora_id in running or len(running) < self.config.max_loras

    def _admit(self, req: Request, num_hit: int, n: int, plan: _StepPlan) -> None:
        """A waiting request joins the batch with its first n uncached tokens."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            self._stats.prefix_cache_queries += req.num_tokens
            self._stats.prefix_cache_hits += num_hit
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.RUNNING
        req.admitted_step = self.step_id + 1  # this step's id
        if not req.first_scheduled_time:
            req.first_scheduled_time = time.monotonic()
        if self.by_priority:
            bisect.insort(self.running, req, key=_priority_order)
        else:
            self.running.append(req)
        plan.num_scheduled[req.request_id] = n
        plan.token_budget -= n
        source, shared = self._prompt_source(req)
        plan.new_reqs.append(NewRequestData(
            req.request_id, req.prompt_token_ids[shared:] if shared else req.prompt_token_ids, req.sampling_params,
            self.kv.block_ids(req.request_id), num_hit, list(req.output_token_ids), req.seed,
            req.eos_token_ids, req.mm_items, lora_request=req.lora_request, shared_from=source, shared_len=shared))
        # publish its prompt blocks now: a later request of this step with the same prefix
        # (the n children of one request) hits them. This step's forward writes their KV
        # (each layer's cache write runs before its attention) before anyone reads them.
        self.kv.cache_blocks(req, num_hit + n)

    def _prompt_source(self, req: Request) -> tuple[str, int]:
        """The running request whose prompt begins with req's first n tokens, and n (("", 0):
        none): the workers hold it through this step (a request preempted in this step is not
        running, one admitted before req in it is added first), and copy those tokens from its
        row rather than receive them (NewRequestData.shared_from)."""
        if req.prompt_source is None or req.mm_items:
            return "", 0
        ref, n = req.prompt_source
        source = ref()
        if source is None or source.status != RequestStatus.RUNNING or self.requests.get(source.request_id) is not source:
            return "", 0
        return source.request_id, n

    def _advance(self, plan: _StepPlan) -> None:
        """Move every scheduled request's counters past this step, as if its tokens were back."""
        for rid, n in plan.num_scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1   # this step samples a token we will only see later
                if self.spec is not None:   # (without speculation no step has draft slots: none to record)
                    req.draft_slots.append(len(plan.spec.get(rid, ())) + plan.draft_slots.get(rid, 0))
            # MFU metrics: tokens c-n..c-1 attend to c-n+1..c keys each; the chunk reads c KV tokens
            self._stats.num_attn_query_key_pairs += n * req.num_computed_tokens - n * (n - 1) // 2
            self._stats.num_kv_tokens_read += req.num_computed_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if req.mm_items:
                self.encoder.advance(req)
            if req.num_computed_tokens <= req.num_prompt_tokens:
                self._stats.num_prompt_tokens += n
        self._stats.num_preemptions += len(plan.preempted)
        self._stats.num_scheduled_tokens += sum(plan.num_scheduled.values())

    def _step_output(self, plan: _StepPlan, defer_sample: bool) -> SchedulerOutput:
        req_ids = list(plan.num_scheduled)
        finished, self.finished_req_ids = self.finished_req_ids, []
        released, self.released_mm = self.released_mm, []
        self.step_id += 1
        so = SchedulerOutput(plan.new_reqs, plan.cached, req_ids, list(plan.num_scheduled.values()),
                             finished_req_ids=finished, step_id=self.step_id, scheduled_encoder_inputs=plan.encode,
                             free_encoder_hashes=self.encoder.take_free(), released_mm=released,
                             defer_sample=defer_sample, scheduled_spec_decode_tokens=plan.spec,
                             spec_draft_slots=plan.draft_slots)
        if self.kv.pool.cpu_tier is not None:
            so.kv_transfers = self.kv.pool.cpu_tier.take_transfers()
        if not defer_sample:
            so.grammar = self.grammar_bitmask(so)
        return so

    def grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        """`so`'s grammar bitmask, once every token before it is accepted."""
        return self.structured.grammar_bitmask(so, self.requests)

    def has_schedulable_waiting(self) -> bool:
        """Whether a waiting request could join now (not all of them wait for their grammar)."""
        return any(self.structured.ready(req) for req in self.waiting)

    def _commit_encoder(self, req: Request, fit: EncoderFit, plan: _StepPlan) -> None:
        """req runs `fit` in this step: its images are encoded with it, out of the step's budget."""
        self.encoder.commit(req, fit)
        if fit.to_encode:
            plan.encode[req.request_id] = fit.to_encode
        plan.encoder_budget -= fit.cost

    def preempt_all(self) -> None:
        """Free every running request's KV; they resume, recomputed, in their order."""
        while self.running:  # newest first, so the oldest ends up at the front of the queue
            self._preempt(self.running.pop())

    def _at_limit(self, req: Request, pending_drafts: int = 0) -> bool:
        """With tokens still in flight, whether those may already reach max_tokens or max_model_len
        (pending_drafts: their draft slots, LOOM_SPEC_ASYNC; every one may be accepted, and a step
        placed behind them must not land past max_model_len)."""
        pending = req.num_output_placeholders + pending_drafts
        return pending > 0 and (len(req.output_token_ids) + pending >= req.max_tokens
                                or req.num_tokens + pending >= self.config.max_model_len)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.encoder.drop_request(req)
        req.num_output_placeholders = 0   # a token still in flight for it is dropped; recompute makes it again
        req.spec_token_ids, req.draft_slots = [], []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.prompt_logprobs_seen = 0      # recomputed from the start: those sent already are not sent again
        self._enqueue(req, front=True)
        self.finished_req_ids.append(req.request_id)  # workers drop its state; it comes back as new

    def _fail_unfittable(self, req: Request) -> None:
        """Alone, and still too big for the whole cache: it can never run."""
        self._fail_waiting(req, f"request needs {req.num_tokens} tokens of KV cache but only "
                                f"{self.kv.num_blocks * self.config.block_size} exist")

    def _fail_waiting(self, req: Request, reason: str) -> None:
        """The head of the queue can never run: it fails alone, reported with the next outputs."""
        self.waiting.popleft()
        self._free(req, RequestStatus.FINISHED_ERROR)
        req.stop_reason = reason
        self._unfittable.append(req)

    def update_from_output(self, out: ModelRunnerOutput, step_id: int | None = None
                           ) -> dict[int, list[EngineCoreOutput]]:
        """Append sampled tokens, finish what stopped; outputs grouped by client_index.
        step_id: the step `out` comes from. A request preempted while it ran and taken back
        in a later step (the core keeps up to three steps in flight) ignores its rows."""
        outputs: dict[int, list[EngineCoreOutput]] = {}
        for req in self._unfittable:
            outputs.setdefault(req.client_index, []).append(
                EngineCoreOutput(req.request_id, [], "error", error=str(req.stop_reason)))
        self._unfittable = []
        logprobs = out.logprobs or {}
        prompt_logprobs = out.prompt_logprobs or {}
        failed, refused = out.failed or {}, out.refused or {}
        spec_accepted, spec_next, placed = out.spec_accepted or {}, out.spec_token_ids or {}, out.spec_num_drafts or {}
        pooled = out.pooled
        for rid, token in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests.get(rid)
            if (req is None or req.status != RequestStatus.RUNNING
                    or (step_id is not None and step_id < req.admitted_step)):
                continue  # aborted or preempted while the step ran (and maybe running again since)
            if rid in failed or rid in refused:  # it failed alone in the worker: end it with its error
                req.num_output_placeholders = 0
                self.running.remove(req)
                self._free(req, RequestStatus.FINISHED_ERROR)
                if rid in failed:
                    out_err = EngineCoreOutput(rid, [], "error", INTERNAL_ERROR,
                                               error=f"the request failed in the worker: {failed[rid]}")
                else:   # its own inputs: a refusal (a 400) while it has no tokens
                    out_err = EngineCoreOutput(rid, [], "error", error=refused[rid])
                outputs.setdefault(req.client_index, []).append(out_err)
                continue
            if pooled and rid in pooled:   # a pooling request ends with its prefill (ipc/pooling.py)
                req.num_output_placeholders = 0
                self.running.remove(req)
                self._free(req, RequestStatus.FINISHED_STOPPED)
                outputs.setdefault(req.client_index, []).append(EngineCoreOutput(
                    rid, [], "stop", num_cached_tokens=max(req.num_cached_tokens, 0), pooled=pooled[rid]))
                continue
            plp = self._new_prompt_logprobs(req, prompt_logprobs.get(rid))
            if token < 0:
                if plp is not None:
                    outputs.setdefault(req.client_index, []).append(EngineCoreOutput(rid, [], prompt_logprobs=plp))
                continue  # a prompt chunk: nothing sampled yet
            tokens = self._verified(req, spec_accepted.get(rid, []), token, placed.get(rid))
            req.num_output_placeholders -= 1
            if not req.first_token_time:
                req.first_token_time = time.monotonic()
            new, status = self._append_tokens(req, tokens)
            self.kv.update_block_hashes(req)
            error = req.grammar.error if req.grammar is not None else None   # (its token broke the grammar)
            lp = logprobs.get(rid) if error is None else None
            if lp is not None and len(new) < len(tokens):   # stopped inside the accepted drafts
                lp = _first_logprobs(lp, len(new))
            outputs.setdefault(req.client_index, []).append(EngineCoreOutput(
                rid, new if error is None else [], status.finish_reason if status else None,
                req.stop_reason, lp, plp, max(req.num_cached_tokens, 0), error))
            if status is not None:
                self.running.remove(req)
                self._free(req, status)
            elif not self.spec_async or req.grammar is not None:   # (none: drafts an older step proposed
                # are stale; under LOOM_SPEC_ASYNC an unconstrained request's drafts stay in the worker)
                req.spec_token_ids = spec_next.get(rid, [])
        return outputs

    def accept_ahead(self, out: ModelRunnerOutput, step_id: int | None = None) -> None:
        """Advance the grammars of the requests update_from_output(out) will give exactly one token
        (no drafts), so that the next step's bitmask fill can start before the update runs."""
        failed, refused, accepted = out.failed or {}, out.refused or {}, out.spec_accepted or {}
        for rid, token in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests.get(rid)
            if (token < 0 or req is None or req.status != RequestStatus.RUNNING or rid in failed or rid in refused
                    or rid in accepted or (req.draft_slots and req.draft_slots[0])
                    or (step_id is not None and step_id < req.admitted_step)
                    or (out.pooled and rid in out.pooled) or not self.structured.can_accept_ahead(req)):
                continue
            self.structured.accept_ahead(req, token)

    def _verified(self, req: Request, accepted: list[int], token: int, placed: int | None) -> list[int]:
        """A step's new tokens for req: its accepted drafts, then the sampled one. The rejected
        drafts' slots roll back (their KV is rewritten by later steps; no block holding one was
        hashed: only blocks full of accepted tokens are); so do the slots the worker had no draft
        for (placed: the drafts it put in the step's draft slots, LOOM_SPEC_ASYNC)."""
        slots = req.draft_slots.pop(0) if req.draft_slots else 0
        drafted = slots if placed is None else placed
        req.num_computed_tokens -= slots - len(accepted)
        if drafted:
            st = self._stats
            st.spec_num_drafts += 1
            st.spec_num_draft_tokens += drafted
            st.spec_num_accepted_tokens += len(accepted)
            if len(st.spec_accepted_per_pos) < drafted:
                st.spec_accepted_per_pos += [0] * (drafted - len(st.spec_accepted_per_pos))
            for i in range(len(accepted)):
                st.spec_accepted_per_pos[i] += 1
        return [*accepted, token]

    def _append_tokens(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens one by one until one stops the request; those appended and the stop."""
        status = None
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            self._stats.num_generation_tokens += 1
            status = self._check_stop(req, token)
            if req.grammar is not None and self.structured.accept(req, token):   # the grammar has ended
                status = RequestStatus.FINISHED_ERROR if req.grammar.error else RequestStatus.FINISHED_STOPPED
            if status is not None:
                return tokens[:i + 1], status
        return tokens, None

    @staticmethod
    def _new_prompt_logprobs(req: Request, plp: PromptLogprobs | None) -> PromptLogprobs | None:
        """The part of a chunk's prompt logprobs not sent before (a preempted request recomputes)."""
        if plp is None:
            return None
        skip = req.prompt_logprobs_sent - req.prompt_logprobs_seen
        req.prompt_logprobs_seen += len(plp.ranks)
        if skip <= 0:
            req.prompt_logprobs_sent = req.prompt_logprobs_seen
            return plp
        if skip >= len(plp.ranks):
            return None
        req.prompt_logprobs_sent = req.prompt_logprobs_seen
        return PromptLogprobs(plp.token_ids[skip:], plp.logprobs[skip:], plp.ranks[skip:])

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        n_out = len(req.output_token_ids)
        params = req.sampling_params
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        stats, self._stats = self._stats, SchedulerStats()
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.kv_cache_usage = self.kv.usage()
        if self.config.enable_lora:   # vllm:lora_requests_info
            stats.running_lora_adapters = _count_loras(self.running)
            stats.waiting_lora_adapters = _count_loras(self.waiting)
        return stats

    def has_timings(self) -> bool:
        return bool(self._timings)

    def take_timings(self) -> list[tuple[int, RequestTiming]]:
        timings, self._timings = self._timings, []
        return timings

    def reset_prefix_cache(self, keep_cpu_tier: bool = False) -> bool:
        return self.kv.reset_prefix_cache(keep_cpu_tier)
