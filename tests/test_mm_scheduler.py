"""The scheduler's encoder budget and cache, in-process: an image is encoded in the step whose
tokens reach its placeholders, a step never starts a placeholder range whose encoder output is
neither cached nor encodable now, an image shared by two requests is encoded once, outputs are
dropped once computed past, a finished request releases its store references at once, and the
image hashes key the prefix cache."""
from __future__ import annotations

from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from ipc.config import EngineConfig
from ipc.messages import EngineCoreRequest, ModelRunnerOutput, MultiModalItem
from ipc.sampling_params import SamplingParams

PAD = 9


def cfg(**kw) -> EngineConfig:
    base = dict(model="unused", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                mm_encoder_budget=16)
    base.update(kw)
    return EngineConfig(**base)


def mm_req(rid: str, images: list[tuple[str, int]], text: int = 3, addr: int = 0) -> Request:
    """text tokens, then each image's placeholders (hash, length), then text again."""
    prompt, items = [1] * text, []
    for i, (h, n) in enumerate(images):
        items.append(MultiModalItem("image", h, len(prompt), n, "loom_mm_test", addr + i))
        prompt += [PAD] * n + [2]
    ecr = EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=2), [0], mm_items=items)
    return Request(ecr, 256, 0)


def step(s: Scheduler):
    so = s.schedule()
    sampled = [7 if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else -1 for r in so.req_ids]
    s.update_from_output(ModelRunnerOutput(list(so.req_ids), sampled))
    return so


def test_encoder_runs_when_tokens_reach_the_image_and_chunks_may_split_it():
    s = Scheduler(cfg(), 64)
    s.add_request(mm_req("a", [("h1", 12)]))        # tokens 3..14 are the image
    so = step(s)                                      # 16 tokens: text + the whole image
    assert so.scheduled_encoder_inputs == {"a": [0]}
    s2 = Scheduler(cfg(max_num_batched_tokens=8), 64)
    s2.add_request(mm_req("a", [("h1", 12)]))
    so = step(s2)                                     # tokens 0..7 reach into the image: encode now
    assert so.scheduled_encoder_inputs == {"a": [0]} and so.num_scheduled_tokens == [8]
    so = step(s2)                                     # 8..15: the rest of it, from the cache
    assert so.scheduled_encoder_inputs == {} and "h1" in so.free_encoder_hashes


def test_a_range_that_cannot_be_encoded_is_not_started():
    s = Scheduler(cfg(max_num_batched_tokens=64), 64)
    s.add_request(mm_req("a", [("h1", 12)]))
    s.add_request(mm_req("b", [("h2", 12)]))         # 12 + 12 > the encoder budget of 16
    so = step(s)
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert dict(zip(so.req_ids, so.num_scheduled_tokens))["a"] == 16
    assert "b" not in so.req_ids or dict(zip(so.req_ids, so.num_scheduled_tokens))["b"] <= 3
    so = step(s)
    assert so.scheduled_encoder_inputs.get("b") == [0]


def test_a_shared_image_is_encoded_once_and_freed_after_both():
    s = Scheduler(cfg(max_num_batched_tokens=64), 64)
    s.add_request(mm_req("a", [("same", 12)]))
    s.add_request(mm_req("b", [("same", 12)], addr=5))
    so = step(s)
    assert so.scheduled_encoder_inputs == {"a": [0]} and set(so.req_ids) == {"a", "b"}
    assert so.free_encoder_hashes == ["same"]         # both computed past it in this step
    assert s.encoder.used == 0


def test_finished_and_aborted_requests_release_their_store_references():
    s = Scheduler(cfg(max_num_batched_tokens=64), 64)
    s.add_request(mm_req("a", [("h1", 4), ("h2", 4)], addr=10))
    while "a" in s.requests:
        assert not step(s).released_mm
    assert s.has_releases()                           # the engine steps once more, even if idle
    assert sorted(s.schedule().released_mm) == [("loom_mm_test", 10), ("loom_mm_test", 11)]
    s.add_request(mm_req("b", [("h3", 4)], addr=20))  # aborted before it ever ran
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.schedule().released_mm == [("loom_mm_test", 20)]


def test_image_hashes_are_block_hash_extra_keys():
    s = Scheduler(cfg(), 64)
    a, b, c = mm_req("a", [("h1", 8)]), mm_req("b", [("h1", 8)]), mm_req("c", [("h2", 8)])
    for r in (a, b, c):
        s.kv.update_block_hashes(r)
    assert a.block_hashes == b.block_hashes
    assert a.block_hashes[0] != c.block_hashes[0]     # block 0 holds image tokens 3..
    assert a.prompt_token_ids == c.prompt_token_ids
