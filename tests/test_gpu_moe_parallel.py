"""GPU checks of mixture-of-experts parallelism (two GPUs, NCCL; run on nvidia-h200-x2 by
`SECTIONS=moe-parallel bench/gpu_tp.sh`): a Qwen3-MoE of 16 experts, top 4, at TP=2 (every
expert's intermediate dim split) and EP=2 (--enable-expert-parallel: 8 whole experts per GPU),
fp32 greedy equal to HF's with the decode steps in CUDA graphs (the routing, the expert map and
the experts captured), and EP=2 equal to TP=2 in bf16."""
from __future__ import annotations

import pytest
import torch

from frontend import LLM, SamplingParams
from tests.test_gpu import GREEDY, PROMPTS, _first_divergence, _hf_greedy_cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module")
def moe_model(model_factory):
    return model_factory("qwen3_moe", hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                         moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, vocab_size=337)


def _greedy(model_dir, params=GREEDY, **options) -> list[list[int]]:
    llm = LLM(model_dir, max_model_len=256, **options)
    try:
        return [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_fp32_matches_hf_exactly(moe_model, expert_parallel):
    assert _greedy(moe_model, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel) == \
        _hf_greedy_cuda(moe_model, torch.float32, PROMPTS, 48)


def test_moe_ep2_bf16_matches_tp2(moe_model):
    """bf16: EP sums each token's experts on their ranks, TP every expert's halves; the orders
    differ, so greedy output may part only at a near-tie (reported, and at least 16 tokens agree)."""
    tp = _greedy(moe_model, tensor_parallel_size=2)
    ep = _greedy(moe_model, tensor_parallel_size=2, enable_expert_parallel=True)
    for a, b in zip(tp, ep):
        d = _first_divergence(a, b)
        print(f"MoE EP=2 vs TP=2 bf16: first divergence at {d} of {len(a)}")
        assert d >= 16, f"EP=2 parts from TP=2 at token {d}"


def test_moe_ep2_sampled_rows_agree_across_ranks(moe_model):
    """Seeded sampling at EP=2 is reproducible (both ranks sample the same tokens from the same
    summed logits: a rank out of step would hang or diverge)."""
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=32, ignore_eos=True) for s in range(len(PROMPTS))]
    llm = LLM(moe_model, max_model_len=256, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        outs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                              use_tqdm=False)] for _ in range(2)]
    finally:
        llm.shutdown()
    assert outs[0] == outs[1]
