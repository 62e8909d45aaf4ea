"""Images through the whole engine (LLM -> shm store -> engine core -> worker: vision tower,
encoder cache, inputs_embeds, M-RoPE) match HF transformers token for token (greedy, fp32, CPU)
on a random tiny Qwen2.5-VL with rope_theta 100 (every M-RoPE section turns)."""
from __future__ import annotations

import os

import msgspec
import pytest

from frontend import LLM, SamplingParams
from tests.tiny_vl_models import hf_qwen_vl_greedy, make_tiny_qwen2_5_vl, random_image

MAX_NEW = 10
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory):
    return make_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def llm(qwen_vl_dir):
    llm = LLM(qwen_vl_dir, max_model_len=512, max_num_seqs=4, block_size=8, mm_processor_cache_gb=0.02)
    yield llm
    llm.shutdown()


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def check(llm, model_dir, cases, **gen):
    """cases: (prompt text, images); all generated in one batch, each compared with HF alone."""
    prompts = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in cases]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (p, imgs), o in zip(cases, outs):
        ids, ref = hf_qwen_vl_greedy(model_dir, p, imgs, MAX_NEW)
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids == ref, f"{len(imgs)} image(s): diverged from HF"
    return outs


def test_one_image(llm, qwen_vl_dir):
    check(llm, qwen_vl_dir, [(chat(IMG + "Describe it."), [random_image(0, 90, 130)])])


def test_an_unreadable_store_handle_fails_its_request_alone(llm, qwen_vl_dir, monkeypatch):
    """An attached client may send a handle that is well-formed but names no store entry (A: a
    missing segment; C: an address past the end of the real one). Three image requests in one
    step: A and C fail alone with the reason, B matches HF, and the engine serves on."""
    add = llm.client.add_request
    sent, replaced = [], []

    def break_handles(ecr, engine):
        if len(sent) in (0, 2):   # A and C (their own hashes: a hash is trusted, docs/protocol.md)
            replaced.extend(ecr.mm_items)   # the engine releases the broken handles instead
            name, addr = ("loom_mm_nosuch_c0", 128) if not sent else (ecr.mm_items[0].store_name, 1 << 40)
            ecr.mm_items = [msgspec.structs.replace(it, store_name=name, store_addr=addr, hash=f"bad{len(sent)}")
                            for it in ecr.mm_items]
        sent.append(ecr.request_id)
        add(ecr, engine)

    monkeypatch.setattr(llm.client, "add_request", break_handles)
    prompt = chat(IMG + "Describe it.")
    image = random_image(30, 90, 130)
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": random_image(31, 60, 60)}},
                         {"prompt": prompt, "multi_modal_data": {"image": image}},
                         {"prompt": prompt, "multi_modal_data": {"image": random_image(32, 60, 60)}}],
                        greedy(), use_tqdm=False)
    monkeypatch.undo()
    llm.mm.unref(replaced)
    for failed in (outs[0], outs[2]):
        assert failed.outputs[0].finish_reason == "error", failed
        assert failed.outputs[0].token_ids == []
    assert outs[1].outputs[0].token_ids == hf_qwen_vl_greedy(qwen_vl_dir, prompt, [image], MAX_NEW)[1]
    check(llm, qwen_vl_dir, [(chat(IMG + "after"), [random_image(33, 56, 56)])])
    assert llm.debug_info()["live_requests"] == 0


def test_two_images_in_one_message(llm, qwen_vl_dir):
    check(llm, qwen_vl_dir, [(chat(IMG + "and" + IMG + "compare"), [random_image(1, 60, 60), random_image(2, 120, 64)])])


def test_images_of_different_sizes_in_one_batch_with_text(llm, qwen_vl_dir):
    check(llm, qwen_vl_dir, [(chat(IMG + "one"), [random_image(3, 56, 56)]),
                             (chat("Hello world! How are you today?"), []),
                             (chat(IMG + "two"), [random_image(4, 200, 90)]),
                             (chat(IMG + "three"), [random_image(5, 150, 150)])])


def test_image_request_arrives_while_text_runs(llm, qwen_vl_dir):
    text = [chat("Tell me a story about a cat."), chat("Readability counts.")]
    ids = llm.enqueue(text, greedy(40))
    img = random_image(6, 100, 80)
    llm.enqueue({"prompt": chat(IMG + "late"), "multi_modal_data": {"image": img}}, greedy())
    outs = llm.wait_for_completion()
    assert len(ids) == 2
    _, ref = hf_qwen_vl_greedy(qwen_vl_dir, chat(IMG + "late"), [img], MAX_NEW)
    assert outs[2].outputs[0].token_ids == ref
    for p, o in zip(text, outs[:2]):
        assert o.outputs[0].token_ids == hf_qwen_vl_greedy(qwen_vl_dir, p, [], 40)[1]


def test_prefix_cache_same_image_hits_different_image_misses(llm, qwen_vl_dir):
    prompt = chat(IMG + "What is in this picture? Tell me a story about it.")
    a, b = random_image(7, 112, 112), random_image(8, 112, 112)
    first = check(llm, qwen_vl_dir, [(prompt, [a])])[0]
    again = check(llm, qwen_vl_dir, [(prompt, [a])])[0]
    other = check(llm, qwen_vl_dir, [(prompt, [b])])[0]
    n = len(first.prompt_token_ids)
    image_start = first.prompt_token_ids.index(first.prompt_token_ids[4])  # after "<|im_start|>user\n<|vision_start|>"
    assert again.num_cached_tokens >= n - 8, "the same image again should hit (all but the last block)"
    assert other.num_cached_tokens <= image_start, "a different image must not reuse the image's blocks"


def test_mm_processor_kwargs_change_the_tokens(llm, qwen_vl_dir):
    img = random_image(9, 200, 200)
    prompt = chat(IMG + "small")
    small = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img},
                          "mm_processor_kwargs": {"max_pixels": 28 * 28 * 4}}, greedy(), use_tqdm=False)[0]
    ids, ref = hf_qwen_vl_greedy(qwen_vl_dir, prompt, [img], MAX_NEW, {"max_pixels": 28 * 28 * 4})
    assert small.prompt_token_ids == ids and small.outputs[0].token_ids == ref
    full = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img}}, greedy(), use_tqdm=False)[0]
    assert len(full.prompt_token_ids) > len(small.prompt_token_ids)


def test_chat_with_an_image_part(llm, qwen_vl_dir):
    import base64
    import io
    img = random_image(10, 84, 84)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    out = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "Describe it."}]}],
                   greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_qwen_vl_greedy(qwen_vl_dir, chat(IMG + "Describe it."), [img], MAX_NEW)[1]


def test_too_many_images_and_no_placeholder_fail(llm):
    img = random_image(11, 56, 56)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": chat("no placeholder"), "multi_modal_data": {"image": img}}, greedy(), use_tqdm=False)
    # nothing was left referenced: the engine still serves
    assert llm.generate(chat("hi"), greedy(2), use_tqdm=False)[0].outputs[0].token_ids


def test_chunked_prefill_and_preemption(qwen_vl_dir, monkeypatch):
    """A token budget of 16 splits every image's placeholder range over several steps (the
    encoder output stays cached in between); a KV cache of 24 blocks of 8 cannot hold the
    three requests at once, so some are preempted and recomputed (the encoder runs again).
    Decodes run the decode graphs' path uncaptured (as on a GPU: M-RoPE positions staged
    [3, B], padded batches)."""
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    cases = [(chat(IMG + "one"), [random_image(12, 224, 224)]),
             (chat(IMG + "two" + IMG), [random_image(13, 84, 84), random_image(14, 168, 168)]),
             (chat(IMG + "three"), [random_image(15, 200, 220)])]
    with LLM(qwen_vl_dir, max_model_len=192, max_num_seqs=3, max_num_batched_tokens=16, block_size=8,
             num_gpu_blocks_override=24, mm_processor_cache_gb=0.02, enable_prefix_caching=False) as llm:
        check(llm, qwen_vl_dir, cases)
        assert llm.stats.num_preemptions > 0


def test_tensor_parallel(qwen_vl_dir):
    """At TP=2 (two gloo ranks): the vision tower runs on both ranks from the image in the
    store (two readers), the language model is sharded, and the tokens are HF's."""
    with LLM(qwen_vl_dir, max_model_len=256, max_num_seqs=2, block_size=8, tensor_parallel_size=2,
             mm_processor_cache_gb=0.02) as llm:
        check(llm, qwen_vl_dir, [(chat(IMG + "split"), [random_image(17, 112, 84)]), (chat("text only"), [])])


def test_data_parallel(qwen_vl_dir):
    """At DP=2 both engines' workers read the one store (readers of their own): images work on
    each engine, and an entry is free once the engine its request went to is done with it, so
    60 distinct images pass through a store that holds about 25 (it used to fill: an engine's
    worker released as the other engine's, and found the segment already unlinked)."""
    with LLM(qwen_vl_dir, max_model_len=256, max_num_seqs=2, block_size=8, data_parallel_size=2,
             mm_processor_cache_gb=0.002) as llm:
        # (prompts that differ in their first KV block: no prefix affinity to one engine)
        check(llm, qwen_vl_dir, [(chat("one: " + IMG), [random_image(21, 56, 84)]),
                                 (chat("two: " + IMG), [random_image(22, 84, 56)])])
        assert all(llm.router.sent), llm.router.sent   # each engine had an image request
        for i in range(60):
            out = llm.generate({"prompt": chat(f"{i}: " + IMG), "multi_modal_data": {"image": random_image(100 + i, 56, 56)}},
                               greedy(1), use_tqdm=False)
            assert out[0].outputs[0].finish_reason == "length", (i, out[0].outputs[0])


def test_triton_mrope_kernel_path(qwen_vl_dir):
    """The fused rotary kernel with 3-row positions (run by the Triton interpreter on CPU). The
    kernel is the worker's: the engine in this process (no worker process to start)."""
    with LLM(qwen_vl_dir, multiprocess=False, max_model_len=256, max_num_seqs=2, block_size=8,
             attention_backend="triton", mm_processor_cache_gb=0.02) as llm:
        check(llm, qwen_vl_dir, [(chat(IMG + "kernel"), [random_image(16, 84, 112)])])


def test_store_segment_unlinked_once_every_worker_mapped_it(llm):
    """After the first image request every process has the segment mapped, and it is unlinked:
    from then on even a SIGKILL of everything leaves nothing in /dev/shm."""
    llm.generate({"prompt": chat(IMG), "multi_modal_data": {"image": random_image(17, 56, 56)}}, greedy(1),
                 use_tqdm=False)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"loom_mm_{os.environ['LOOM_RUN_ID']}")]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_thousand_image_requests_bounded_rss_and_store(llm):
    """1,000 requests, each with its own tiny image (the 20 MB store holds about 250 of them, so
    it evicts as it goes): the store stays within its size, and no process grows."""
    from tests.conftest import child_pids
    engine = llm.engine_procs[0].pid
    procs = [os.getpid(), engine] + child_pids(engine)

    def batch(seed: int, n: int):
        prompts = [{"prompt": chat(IMG), "multi_modal_data": {"image": random_image(seed + i, 28, 28)}}
                   for i in range(n)]
        outs = llm.generate(prompts, greedy(1), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)

    batch(100_000, 200)  # warm up: allocator pools, caches
    before = [_rss_mb(p) for p in procs]
    batch(200_000, 1000)
    after = [_rss_mb(p) for p in procs]
    store = llm.mm.store
    assert store.used_bytes() <= store.capacity and store.num_entries() < 400
    assert all(a - b < 60 for a, b in zip(after, before)), f"RSS grew: {before} -> {after} MB"
    assert llm.debug_info()["live_requests"] == 0
