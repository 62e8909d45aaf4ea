"""The scheduler and KV-cache manager in-process: block arithmetic, prefix-cache
hashing, chunking, preemption, and object lifetimes without the cyclic GC."""
from __future__ import annotations

import gc
import weakref

import pytest

from ipc.config import EngineConfig
from engine_core.kv_cache_manager import KVCacheManager, cdiv, hash_block
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from ipc.messages import EngineCoreRequest, ModelRunnerOutput
from ipc.sampling_params import SamplingParams


def cfg(**kw) -> EngineConfig:
    base = dict(model="unused", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
    base.update(kw)
    return EngineConfig(**base)


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> Request:
    return Request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), [0]), 256, 0)


def fake_step(s: Scheduler, token: int = 7):
    so = s.schedule()
    sampled = [token if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else -1
               for r in so.req_ids]
    return so, s.update_from_output(ModelRunnerOutput(list(so.req_ids), sampled))


def test_block_arithmetic():
    assert [cdiv(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    kv = KVCacheManager(10, 4, enable_caching=False)
    r = req("a", list(range(1, 10)))  # 9 tokens -> 3 blocks
    assert len(kv.allocate_slots(r, 9)) == 3
    r.num_computed_tokens = 9
    assert len(kv.allocate_slots(r, 3)) == 0   # 12 tokens still fit in 3 blocks
    assert len(kv.allocate_slots(r, 4)) == 1   # 13 need a 4th
    assert kv.usage() == pytest.approx(0.4)
    kv.free(r)
    assert kv.usage() == 0.0


def test_prefix_hits_follow_hash_chain():
    s = Scheduler(cfg(), 64)
    prefix = list(range(100, 110))        # 10 tokens: 2 full blocks of 4
    a = req("a", prefix + [1, 2, 3])
    s.add_request(a)
    while s.has_unfinished():
        fake_step(s)
    b = req("b", prefix + [9])
    s.add_request(b)
    fake_step(s)
    assert b.num_cached_tokens == 8       # the third block differs
    h0 = hash_block(None, prefix[:4])
    assert b.block_hashes[:2] == [h0, hash_block(h0, prefix[4:8])]
    # a hit never covers the whole prompt: the last token must be computed
    c = req("c", prefix[:8])
    s.add_request(c)
    fake_step(s)
    assert c.num_cached_tokens == 4


def test_freed_blocks_are_revived_lru():
    kv = KVCacheManager(4, 4, enable_caching=True)
    a = req("a", list(range(1, 9)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    b = req("b", list(range(1, 9)) + [50])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2                 # still cached while free
    assert kv.allocate_slots(b, 1, hits) is not None
    assert kv.pool.num_free_blocks == 1


def test_chunked_prefill_and_decode_share_a_step():
    s = Scheduler(cfg(max_num_batched_tokens=8), 64)
    a, b = req("a", [1, 2, 3]), req("b", list(range(10, 30)))
    s.add_request(a)
    fake_step(s)                                    # a's prompt
    s.add_request(b)
    so, _ = fake_step(s)
    assert dict(zip(so.req_ids, so.num_scheduled_tokens)) == {"a": 1, "b": 7}
    so, _ = fake_step(s)
    assert dict(zip(so.req_ids, so.num_scheduled_tokens)) == {"a": 1, "b": 7}


def test_short_prompts_go_a_token_per_step_beside_others():
    """config.stepwise_prompt_tokens (Whisper's decoder prompt): a prompt that short, joining running
    requests, is fed one token per step, so that every step is all one-token rows (a decode graph's);
    alone it goes whole, and a longer prompt in chunks as before."""
    s = Scheduler(cfg(stepwise_prompt_tokens=4), 64)
    a, b, c = req("a", [1, 2, 3, 4], max_tokens=20), req("b", [5, 6, 7, 8], max_tokens=20), req("c", list(range(10, 16)))
    s.add_request(a)
    so, _ = fake_step(s)
    assert dict(zip(so.req_ids, so.num_scheduled_tokens)) == {"a": 4}          # alone: whole
    s.add_request(b)
    s.add_request(c)
    for k in range(4):
        so, _ = fake_step(s)
        steps = dict(zip(so.req_ids, so.num_scheduled_tokens))
        assert steps["a"] == 1 and steps["b"] == 1, k                         # b: one prompt token a step
        assert steps.get("c", 0) == (6 if k == 0 else 1)                      # c: 6 > 4 tokens, one chunk
    assert b.num_computed_tokens == 4 and len(b.output_token_ids) == 1


def test_preemption_requeues_at_front_and_counts():
    s = Scheduler(cfg(block_size=4, max_num_batched_tokens=64), 4)   # 16 tokens of KV in all
    a, b = req("a", list(range(1, 8)), max_tokens=6), req("b", list(range(20, 27)), max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    preempted = 0
    for _ in range(40):
        if not s.has_unfinished():
            break
        fake_step(s)
        preempted += s.make_stats().num_preemptions
    assert not s.has_unfinished()
    assert preempted >= 1
    assert s.kv.pool.num_free_blocks == 4


def test_priority_policy_orders_the_queue_and_preempts_the_lowest():
    # vLLM's --scheduling-policy priority: waiting requests run by (priority, arrival), and
    # preemption takes the running request last in that order; fcfs: arrival order, the newest
    def prio_req(rid: str, priority: int, prompt: list[int], max_tokens: int) -> Request:
        return Request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), [0],
                                         priority=priority), 256, 0)

    def first_scheduled(policy: str) -> list[str]:
        s = Scheduler(cfg(scheduling_policy=policy, max_num_seqs=1), 64)
        for rid, priority in (("late", 5), ("urgent", -1), ("mid", 0), ("mid2", 0)):
            s.add_request(prio_req(rid, priority, [1, 2, 3], 2))
        order = []
        while s.has_unfinished():
            so, _ = fake_step(s)
            order += [r for r in so.req_ids if r not in order]
        return order

    assert first_scheduled("priority") == ["urgent", "mid", "mid2", "late"]
    assert first_scheduled("fcfs") == ["late", "urgent", "mid", "mid2"]

    def preempted(policy: str) -> dict[str, int]:
        s = Scheduler(cfg(scheduling_policy=policy, block_size=4), 4)   # 16 tokens of KV: one must go
        reqs = [prio_req("low", 1, list(range(1, 8)), 6), prio_req("high", 0, list(range(20, 27)), 6)]
        for r in reqs:
            s.add_request(r)
        while s.has_unfinished() and not any(r.num_preemptions for r in reqs):
            fake_step(s)
        return {r.request_id: r.num_preemptions for r in reqs}

    assert preempted("priority") == {"low": 1, "high": 0}
    assert preempted("fcfs") == {"low": 0, "high": 1}   # the newest


def test_unfittable_request_errors_instead_of_looping():
    s = Scheduler(cfg(block_size=4), 2)                 # 8 tokens of KV
    r = req("big", list(range(1, 12)))
    s.add_request(r)
    _, outs = fake_step(s)
    assert outs[0][0].finish_reason == "error"
    assert not s.has_unfinished()


def test_finished_requests_are_freed_without_cyclic_gc():
    gc.disable()
    try:
        s = Scheduler(cfg(), 256)
        refs = []
        for i in range(50):
            r = req(f"r{i}", [1, 2, 3, i + 5], max_tokens=3)
            refs.append(weakref.ref(r))
            s.add_request(r)
            del r
        aborted = s.finish_requests([f"r{i}" for i in range(0, 50, 5)], RequestStatus.FINISHED_ABORTED)
        del aborted
        while s.has_unfinished():
            fake_step(s)
        s.take_timings()
        assert sum(ref() is not None for ref in refs) == 0
        assert s.kv.pool.num_free_blocks == 256
    finally:
        gc.enable()


def test_request_failed_in_the_worker_ends_alone():
    """A request whose per-request work failed in the worker (ModelRunnerOutput.failed) ends with an
    error output; the others in the batch go on."""
    s = Scheduler(cfg(), 64)
    for rid in ("ok", "bad"):
        s.add_request(req(rid, [1, 2, 3]))
    so = s.schedule()
    outs = s.update_from_output(ModelRunnerOutput(list(so.req_ids), [7, 8], failed={"bad": "IndexError: x"}))
    by_id = {o.request_id: o for o in outs[0]}
    assert by_id["bad"].finish_reason == "error" and "IndexError" in by_id["bad"].error
    assert by_id["bad"].stop_reason == "internal"   # the server's failure, not the request's (a 500, not a 400)
    assert by_id["ok"].new_token_ids == [7] and by_id["ok"].finish_reason is None
    assert "bad" not in s.requests and [r.request_id for r in s.running] == ["ok"]
    _, outs = fake_step(s)
    assert [o.request_id for o in outs[0]] == ["ok"]


def test_prompt_logprobs_are_not_sent_twice_after_preemption():
    from ipc.messages import PromptLogprobs
    s = Scheduler(cfg(enable_prefix_caching=True), 64)
    r = req("a", list(range(1, 10)), prompt_logprobs=0)
    s.add_request(r)
    plp = lambda n: PromptLogprobs([[i] for i in range(n)], [[-1.0]] * n, [1] * n)
    so = s.schedule()
    out = s.update_from_output(ModelRunnerOutput(list(so.req_ids), [-1], prompt_logprobs={"a": plp(5)}))
    assert len(out[0][0].prompt_logprobs.ranks) == 5
    s.preempt_all()
    so = s.schedule()   # recomputed from the start: no prefix-cache hit for a prompt-logprobs request
    assert so.new_requests[0].num_computed_tokens == 0
    out = s.update_from_output(ModelRunnerOutput(list(so.req_ids), [7], prompt_logprobs={"a": plp(8)}))
    assert out[0][0].prompt_logprobs.ranks == [1] * 3 and out[0][0].prompt_logprobs.token_ids == [[5], [6], [7]]


def test_rows_of_steps_before_a_preemption_are_ignored_after_readmission():
    """With three steps in flight, a request preempted by step 2 is taken back by step 3 while
    steps 1 and 2 are still out: their rows for it are stale and must not become its tokens."""
    s = Scheduler(cfg(), 64)
    a = req("a", [1, 2, 3], max_tokens=8)
    s.add_request(a)
    so1, so2 = s.schedule(), s.schedule()   # the prompt, then a decode of its placeholder
    s.preempt_all()
    so3 = s.schedule()                      # a again, from the start
    assert so3.new_requests and so3.new_requests[0].req_id == "a"
    for so, token in ((so1, 7), (so2, 8)):
        assert s.update_from_output(ModelRunnerOutput(["a"], [token]), so.step_id) == {}
    assert a.output_token_ids == []
    s.update_from_output(ModelRunnerOutput(["a"], [9]), so3.step_id)
    assert a.output_token_ids == [9]


def _grouped(rid: str, group: str, max_tokens: int = 50, client: int = 0) -> Request:
    return Request(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), [0], client_index=client,
                                     group_id=group), 256, 0)


def test_a_fan_out_leaves_room_for_another_request():
    """Issue 54: one HTTP request's 64 prompts take at most 30 of 32 batch slots, and a later
    single-prompt request joins at the very next step instead of after the whole fan-out."""
    s = Scheduler(cfg(max_num_seqs=32, max_num_batched_tokens=256), 1024)
    for i in range(64):
        s.add_request(_grouped(f"a-{i}", "A"))
    for _ in range(3):
        fake_step(s)
    assert len(s.running) == 30
    s.add_request(_grouped("b", ""))
    so, _ = fake_step(s)
    assert [n.req_id for n in so.new_requests] == ["b"]
    # the same group id from another client (API server) is another group
    s.add_request(_grouped("c", "A", client=1))
    so, _ = fake_step(s)
    assert [n.req_id for n in so.new_requests] == ["c"]


def test_a_fan_out_stops_at_its_cap_within_one_step():
    """Past the cap's threshold of running requests, each admission counts toward its group in
    the same step: a fan-out queued behind two single requests stops at the cap (60 of 64)."""
    s = Scheduler(cfg(max_num_seqs=64, max_num_batched_tokens=1024), 1024)
    for i in range(2):
        s.add_request(_grouped(f"s{i}", ""))
    for i in range(70):
        s.add_request(_grouped(f"a-{i}", "A"))
    so, _ = fake_step(s)
    assert sum(r.startswith("a-") for r in so.req_ids) == s.fair.cap == 60
    assert len(s.running) == 62


def test_fan_outs_take_turns_and_single_requests_stay_first_come_first_served():
    s = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=256), 1024)
    for i in range(8):
        s.add_request(_grouped(f"a-{i}", "A", max_tokens=1))
    for i in range(8):
        s.add_request(_grouped(f"c-{i}", "C", max_tokens=1))
    order = []
    while s.waiting or s.running:
        so, _ = fake_step(s)
        order += [n.req_id for n in so.new_requests]
    assert order[:8] == ["a-0", "c-0", "a-1", "c-1", "a-2", "c-2", "a-3", "c-3"], order
    s2 = Scheduler(cfg(max_num_seqs=2, max_num_batched_tokens=256), 1024)
    for i in range(6):
        s2.add_request(_grouped(f"r{i}", "", max_tokens=1))
    order = []
    while s2.waiting or s2.running:
        so, _ = fake_step(s2)
        order += [n.req_id for n in so.new_requests]
    assert order == [f"r{i}" for i in range(6)]


def test_block_hashes_chain_over_prompt_and_output_tokens():
    """A block that straddles the prompt's end hashes the prompt's tail and the first outputs, as
    the whole token list cut into blocks does (update_block_hashes slices the two lists)."""
    kv = KVCacheManager(64, 4, enable_caching=True)
    r = req("a", list(range(100, 110)))          # 10 prompt tokens: blocks 0-1 full, block 2 half
    kv.update_block_hashes(r)
    assert len(r.block_hashes) == 2
    r.output_token_ids += [7, 8, 9, 10, 11, 12, 13]   # 17 tokens: blocks 2 (2 prompt + 2 output) and 3 (output)
    kv.update_block_hashes(r)
    tokens = r.prompt_token_ids + r.output_token_ids
    want, parent = [], None
    for i in range(len(tokens) // 4):
        parent = hash_block(parent, tokens[4 * i:4 * i + 4])
        want.append(parent)
    assert r.block_hashes == want and len(want) == 4


def _hashed_alone(tokens: list[int], block_size: int, root: bytes | None = None) -> list[bytes]:
    want, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[block_size * i:block_size * (i + 1)])
        want.append(parent)
    return want


def test_hashes_taken_from_a_recent_prompt_equal_hashing_alone():
    """Requests whose prompts begin alike take a recent request's hashes over the blocks both hold
    the same tokens in (RecentPrompts): prompts diverging at every block and mid-block, shorter
    and longer than the other one, one with outputs past its prompt, another adapter's, requests
    gone (held weakly), and more first blocks than are kept: every request's hashes are those
    hashing alone gives, and its prompt_source's tokens begin its prompt."""
    import random

    from ipc.lora import LoRARequest
    rng = random.Random(0)
    kv = KVCacheManager(64, 4, enable_caching=True)
    kv.recent.capacity = 3
    prefixes = [[rng.randrange(1000) for _ in range(40)] for _ in range(5)]
    alive, taken = [], 0
    for i in range(300):
        base = prefixes[rng.randrange(len(prefixes))]
        cut = rng.randrange(len(base) + 1)
        prompt = base[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(12))]
        lora = LoRARequest("a", 1, "/none") if i % 7 == 0 else None
        r = Request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=4), [0], lora_request=lora), 256, 0)
        kv.update_block_hashes(r)
        assert r.block_hashes == _hashed_alone(prompt, 4, b"lora:1" if lora else None), (i, cut)
        if r.prompt_source is not None:
            source, n = r.prompt_source[0](), r.prompt_source[1]
            assert source.prompt_token_ids[:n] == prompt[:n] and n >= 4
            taken += 1
        if rng.random() < 0.8:   # (the others are gone at once)
            alive.append(r)
        if i % 5 == 0:   # outputs past the prompt: the kept list grows; only its prompt's blocks are taken
            r.output_token_ids += [rng.randrange(1000) for _ in range(9)]
            kv.update_block_hashes(r)
            assert r.block_hashes == _hashed_alone(prompt + r.output_token_ids, 4, b"lora:1" if lora else None)
    assert len(kv.recent._by_first) <= 3 and taken > 50, taken


def test_common_blocks():
    from engine_core.recent_prompts import common_blocks
    a = list(range(100))
    for diff in (0, 3, 4, 5, 31, 32, 63, 99):
        b = list(a)
        b[diff] = -1
        assert common_blocks(a, b, 100, 4) == diff // 4
    assert common_blocks(a, a, 100, 4) == 25
    assert common_blocks(a, a[:50], 100, 4) == 12    # full blocks of the shorter one
    assert common_blocks(a, a, 7, 4) == 7            # at most `limit`
