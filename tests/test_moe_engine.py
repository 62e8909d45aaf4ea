"""Mixture of experts through the whole engine (a tiny Qwen3-MoE, in process, fp32 on the CPU):
greedy output equal to HF transformers' under prefix caching, chunked prefill, preemption and
synchronous scheduling; routings forced through the router's weights (every token to one
expert, an expert no token reaches); sleep and wake, and a weight update of the experts by
their checkpoint names (`mlp.experts.{e}.gate_proj.weight`...); structured outputs with async
scheduling on and off. (Every MoE architecture's plain parity, mlp_only_layers,
decoder_sparse_step and Qwen2-MoE's shared expert are tests/test_arch_parity.py's; TP=2 and EP=2
on gloo, tests/test_arch_tp.py's.)"""
from __future__ import annotations

import os
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from frontend import LLM, SamplingParams
from ipc.sampling_params import StructuredOutputsParams
from tests.hf_oracle import hf_greedy, hf_model
from tests.test_engine_parity import check_parity

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _workload(vocab: int) -> list[list[int]]:
    """Three prompts sharing a 21-token prefix (prefix caching) and four others, 2 to 33 tokens."""
    rng = random.Random(1)
    shared = [rng.randrange(3, vocab - 16) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, vocab - 16) for _ in range(k)] for k in (1, 5, 11)]
    return prompts + [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in (2, 19, 33, 7)]


def _gen(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def moe(model_factory):
    """(the tiny Qwen3-MoE: layers 0 and 2 sparse, 8 experts, top 2; the prompts; HF's greedy tokens)."""
    model_dir = model_factory("qwen3_moe")
    prompts = _workload(300)
    return model_dir, prompts, [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("name,options", [
    # max_num_seqs=2: the later prompts are admitted after the shared prefix is cached
    ("prefix_caching", dict(enable_prefix_caching=True, max_num_seqs=2)),
    ("chunked", dict(max_num_batched_tokens=8, max_num_seqs=4)),
    ("preempted", dict(num_gpu_blocks_override=20, max_num_seqs=8)),
    ("sync_chunked_preempted", dict(async_scheduling=False, num_gpu_blocks_override=20, max_num_batched_tokens=8,
                                    max_num_seqs=4)),
])
def test_moe_greedy_under_schedule(moe, name, options):
    model_dir, prompts, ref = moe
    llm = LLM(model_dir, max_model_len=64, block_size=4, **options)
    try:
        assert _gen(llm, prompts) == ref
        stats = llm.stats
    finally:
        llm.shutdown()
    if name == "prefix_caching":
        assert stats.prefix_cache_hits > 0
    if "preempted" in name:
        assert stats.num_preemptions > 0


def force_routing(model_dir: str, out_dir: str, always: int, never: int | None) -> str:
    """model_dir's checkpoint rewired so that expert `always` is among every token's choices and
    `never` among none's, on every sparse layer. Hidden feature 0 is made a constant: 8 in every
    embedding row, and nothing writes it afterwards (row 0 of every o_proj and down projection
    zero), so after each norm it is positive for every token; the routers then read only it from
    feature 0, with weight +20 for `always`, -20 for `never` and 0 for the others. (The lm_head
    ignores it, or the constant would favour a few tokens.)"""
    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    w = load_file(path)
    w["model.embed_tokens.weight"][:, 0] = 8.0
    w["lm_head.weight"][:, 0] = 0.0
    for name, t in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[0] = 0.0
        if name.endswith("mlp.gate.weight"):
            t[:, 0] = 0.0
            t[always, 0] = 20.0
            if never is not None:
                t[never, 0] = -20.0
    save_file(w, path, metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("top_k,always,never", [(2, 3, 5), (1, 6, None)])
def test_forced_routing_matches_hf(model_factory, tmp_path, top_k, always, never):
    """Every token to expert `always` (top 1: to it alone), expert `never` reached by no token
    (top 1: six of the eight idle): the greedy tokens still equal HF's."""
    model_dir = force_routing(model_factory("qwen3_moe", num_experts_per_tok=top_k), str(tmp_path / "forced"),
                              always, never)
    prompts = _workload(300)[2:6]
    hf = hf_model(model_dir)
    with torch.no_grad():   # the routing is what the test says, on every sparse layer (HF's own router)
        routers = hf(torch.tensor([prompts[-1]]), output_router_logits=True).router_logits
    assert len(routers) == 2
    for logits in routers:
        chosen = logits.topk(top_k, dim=-1).indices
        assert (chosen == always).any(-1).all()
        if never is not None:
            assert not (chosen == never).any()
    check_parity(model_dir, prompts, max_new=MAX_NEW, block_size=4, max_num_seqs=2, max_model_len=64)


def test_sleep_wake_and_expert_weight_update(moe, tmp_path):
    """Sleep levels 1 and 2 bring the MoE back as it was; an update of the experts alone, by their
    checkpoint names, gives HF's output on the checkpoint with those experts, and each expert
    tensor reads back by its name."""
    model_dir, prompts, ref = moe
    prompts, ref = prompts[:3], ref[:3]
    other = str(tmp_path / "other-experts")
    shutil.copytree(model_dir, other)
    w = load_file(os.path.join(other, "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    experts = {n: t.normal_(0.0, 0.2, generator=g) for n, t in w.items() if ".experts." in n}
    save_file(w, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    other_ref = [hf_greedy(other, p, MAX_NEW) for p in prompts]
    assert other_ref != ref
    llm = LLM(model_dir, max_model_len=64, block_size=4, enable_sleep_mode=True)
    try:
        assert _gen(llm, prompts) == ref
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert _gen(llm, prompts) == ref
        llm.pause("keep")
        assert llm.update_weights_from_tensor(experts) == len(experts)
        llm.resume()
        assert _gen(llm, prompts) == other_ref
        for name in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.7.up_proj.weight",
                     "model.layers.2.mlp.experts.0.down_proj.weight"):
            assert torch.equal(torch.tensor(llm.get_weights_by_name(name, 1000)), experts[name])
        llm.sleep(1)
        llm.wake_up()
        assert _gen(llm, prompts) == other_ref
    finally:
        llm.shutdown()


def test_structured_output_with_and_without_async_scheduling(moe):
    """A regex and a JSON choice constrain the MoE's sampling: the outputs match them, the same
    with async scheduling (the bitmask of a deferred step) and without."""
    model_dir = moe[0]
    regex = r"\d{2}-[xyz]{1,3}"
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=regex)) for s in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(choice=["cat", "dog"])))
    outs = {}
    for async_scheduling in (True, False):
        with LLM(model_dir, max_model_len=64, async_scheduling=async_scheduling) as llm:
            outs[async_scheduling] = [o.outputs[0].text for o in llm.generate(["Count"] * 4, params, use_tqdm=False)]
    assert outs[True] == outs[False]
    assert all(re.fullmatch(regex, t) for t in outs[True][:3]), outs[True]
    assert outs[True][3] in ("cat", "dog")


@pytest.mark.slow   # two worker processes
def test_expert_parallel_engine(moe):
    """LLM(tensor_parallel_size=2, enable_expert_parallel=True): two gloo worker processes, each
    holding half of the experts whole; greedy output equals HF's, sleep level 2 reloads each rank's
    own experts, and an expert's tensors read back whole by name from the rank that holds them."""
    model_dir, prompts, ref = moe
    llm = LLM(model_dir, max_model_len=64, block_size=4, tensor_parallel_size=2, enable_expert_parallel=True,
              enable_sleep_mode=True, multiprocess=True)
    try:
        info = llm.collective_rpc("all_reduce_info")
        assert [(i["rank"], i["expert_parallel"]) for i in info] == [(0, True), (1, True)]
        assert _gen(llm, prompts) == ref
        llm.sleep(2)
        llm.wake_up()
        assert _gen(llm, prompts[:3]) == ref[:3]
        want = load_file(os.path.join(model_dir, "model.safetensors"))
        for name in ("model.layers.0.mlp.experts.1.up_proj.weight",       # on rank 0 (experts 0-3)
                     "model.layers.2.mlp.experts.6.down_proj.weight"):    # on rank 1 (experts 4-7)
            assert torch.equal(torch.tensor(llm.get_weights_by_name(name, 1000)), want[name])
    finally:
        llm.shutdown()
