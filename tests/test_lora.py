"""Multi-LoRA serving, offline (LLM in-process, tiny fp32 models): an adapter's greedy output is
the merged-weight model's (HF transformers + peft's merge_and_unload), a batch mixing adapters
and the base gives each request's output alone, the prefix cache never hands one adapter's
blocks to another, and adapters that do not fit are refused with nothing loaded."""
from __future__ import annotations

import json
import os

import pytest

from frontend import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_adapter, merged_greedy

ENGINE_IN_PROCESS = True
MAX_NEW = 8
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8, 64, 12, 19, 27, 31, 4, 88, 6], [11, 22, 33]]


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Four adapters: all seven projections (two of them rsLoRA / another alpha), attention only, MLP only."""
    root = tmp_path_factory.mktemp("loras")
    specs = [dict(), dict(use_rslora=True, r=8, alpha=4), dict(targets=("q_proj", "v_proj", "o_proj")),
             dict(targets=("gate_proj", "up_proj", "down_proj"), r=2, alpha=16)]
    return [make_adapter(model_dir, str(root / f"a{i}"), seed=i + 1, **kw) for i, kw in enumerate(specs)]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3, max_model_len=64,
             block_size=4, max_num_seqs=8) as llm:
        yield llm


def _greedy(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_adapter_matches_merged_weights(llm, model_dir, adapters):
    eos = llm.config.eos_token_ids
    for i, path in enumerate(adapters):
        lora = LoRARequest(f"a{i}", i + 1, path)
        got = _greedy(llm, PROMPTS, lora)
        for p, g in zip(PROMPTS, got):
            assert g == merged_greedy(model_dir, path, p, MAX_NEW, eos), f"adapter {i}"
    # and the adapters do change the output (the test could fail)
    base = _greedy(llm, PROMPTS[:1], None)[0]
    assert base == merged_greedy(model_dir, None, PROMPTS[0], MAX_NEW, eos)
    assert any(_greedy(llm, PROMPTS[:1], LoRARequest(f"a{i}", i + 1, p))[0] != base for i, p in enumerate(adapters))


def test_mixed_batch_equals_each_alone(llm, adapters):
    # 4 adapters and the base in one call, over 2 GPU slots: the scheduler admits two adapters at a
    # time, the slots are reused (LRU), and the CPU cache (3) drops one adapter, read again later
    loras = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(10)]
    per = [loras[k % len(loras)] for k in range(10)]
    together = _greedy(llm, prompts, per)
    alone = [_greedy(llm, [p], lr)[0] for p, lr in zip(prompts, per)]
    assert together == alone


def test_prefix_cache_is_keyed_by_adapter(llm, adapters):
    # the same 12-token prompt (3 full blocks) under the base and an adapter: the second run of each
    # hits its own blocks, never the other's
    prompt = list(range(40, 52))
    a = LoRARequest("a0", 1, adapters[0])
    first_base = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4),
                              use_tqdm=False)[0]
    lora_out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4),
                            use_tqdm=False, lora_request=a)[0]
    assert lora_out.num_cached_tokens == 0   # the base's blocks are not the adapter's
    again = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4),
                         use_tqdm=False, lora_request=a)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == lora_out.outputs[0].token_ids
    base_again = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4),
                              use_tqdm=False)[0]
    assert base_again.outputs[0].token_ids == first_base.outputs[0].token_ids


def _rewrite(path: str, out: str, **changes) -> str:
    import shutil
    shutil.copytree(path, out)
    cfg_path = os.path.join(out, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return out


def test_adapters_that_do_not_fit_are_refused(llm, model_dir, adapters, tmp_path):
    before = llm.list_loras()
    too_big = make_adapter(model_dir, str(tmp_path / "r16"), seed=9, r=16)
    with pytest.raises(ValueError, match="max-lora-rank"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("big", 50, too_big))
    dora = _rewrite(adapters[0], str(tmp_path / "dora"), use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        llm.add_lora("dora", 51, dora)
    with pytest.raises(ValueError, match="does not exist"):
        llm.add_lora("missing", 52, str(tmp_path / "nowhere"))
    # an adapter of another model's shapes (a wider hidden size)
    from tests.tiny_models import make_tiny_model
    other = make_tiny_model(str(tmp_path / "wide"), "llama", hidden_size=96)
    wide = make_adapter(other, str(tmp_path / "wide-lora"), seed=3)
    with pytest.raises(ValueError, match="do not fit"):
        llm.add_lora("wide", 53, wide)
    with pytest.raises(ValueError, match="remove it first"):   # an id names one adapter
        llm.add_lora("other", 1, adapters[1])
    assert llm.list_loras() == before   # nothing was kept
    # the engine serves on
    assert _greedy(llm, PROMPTS[:1], LoRARequest("a0", 1, adapters[0]))


def test_lora_request_needs_enable_lora(model_dir, adapters):
    with LLM(model_dir, max_model_len=64, block_size=4) as llm:
        with pytest.raises(ValueError, match="enable-lora"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=LoRARequest("a0", 1, adapters[0]))


def test_tensor_parallel_matches_merged_weights(model_factory, tmp_path):
    # TP=2 on gloo (two worker processes): column-parallel layers shard B's rows per slice (one KV
    # head, replicated on both ranks: k/v's B rows are whole on each), row-parallel layers shard
    # A's input columns and add their partial delta before the all-reduce. Two adapters and the
    # base in one batch, each equal to the merged model (the TP=1 result, tested above).
    model_dir = model_factory("llama", num_key_value_heads=1, vocab_size=337)
    paths = [make_adapter(model_dir, str(tmp_path / "t0"), seed=5),
             make_adapter(model_dir, str(tmp_path / "t1"), seed=6, r=8, use_rslora=True,
                          targets=("k_proj", "o_proj", "up_proj", "down_proj"))]
    loras = [None, LoRARequest("t0", 1, paths[0]), LoRARequest("t1", 2, paths[1])]
    with LLM(model_dir, multiprocess=True, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
             max_model_len=64, block_size=4) as llm:
        got = _greedy(llm, PROMPTS, loras)
        eos = llm.config.eos_token_ids
    for p, lr, g in zip(PROMPTS, loras, got):
        assert g == merged_greedy(model_dir, None if lr is None else lr.lora_path, p, MAX_NEW, eos)
