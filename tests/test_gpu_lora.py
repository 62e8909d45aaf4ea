"""GPU-only LoRA checks (H200 through the device tool; `bench/gpu_suite.sh lora-tests`): the Triton
shrink/expand kernels under CUDA graphs (decode: one row per program; long prefills: 16-row tile
products) give the merged-weight model's greedy tokens in fp32, and the graphs give eager's tokens
in bf16, for batches mixing adapters (more than the GPU slots) and the base model; each with the
kernel variants (LOOM_LORA_SORTED_ROWS=1: every decode batch on the sorted kernels; base-only
steps replay the graphs without LoRA ops, LOOM_LORA_BASE_GRAPHS) and session 31's; and base-only
constrained and penalised steps in the base graph's grammar and penalty heads, as eager."""
from __future__ import annotations

import pytest
import torch

from frontend import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_adapter, merged_model

pytestmark = pytest.mark.gpu
N = 24
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [50, 60, 70], [(7 * i) % 300 + 3 for i in range(300)],
           list(range(100, 140)), [(5 * i) % 250 + 9 for i in range(280)]]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=4)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-loras")
    return [make_adapter(model, str(root / f"g{i}"), seed=40 + i, r=8 if i else 16, std=0.05) for i in range(3)]


def _check_merged_greedy_cuda(model_dir: str, adapter: str | None, prompt: list[int], got: list[int]) -> None:
    """Loom's greedy tokens equal the merged-weight model's, or part from them only at a near-tie
    of the merged model's logits (fp32: W x + s B (A x) and (W + s B A) x round differently, so a
    random model's top two within ~1e-4 may swap), and at least 16 tokens agree."""
    from transformers import AutoModelForCausalLM
    hf = (merged_model(model_dir, adapter) if adapter else
          AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()).cuda()
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        want = hf.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                           attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
        d = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if d is not None:
            logits = hf(torch.tensor([prompt + want[:d]], device="cuda")).logits[0, -1]
            gap = float(logits[want[d]] - logits[got[d]])
    hf.cpu()
    if d is not None:
        assert d >= 16 and gap <= 1e-4, f"{adapter}: parted from the merged model at token {d}, logit gap {gap}"


def _loras(adapters):
    loras = [None] + [LoRARequest(f"g{i}", i + 1, p) for i, p in enumerate(adapters)]
    return [loras[k % len(loras)] for k in range(len(PROMPTS))]


# the kernel variants: as shipped (at batch 1 the shrink fused with the norm or SiLU, at 1-8 rows the
# expand in the GEMV's epilogue); every decode batch of 1+ rows on the sorted kernels (rows in adapter
# order, tile products); session 31's (no base-only graphs, one program per row, the shrink and the
# expand their own kernels, no PDL)
VARIANTS = {"default": {}, "sorted-all": {"LOOM_LORA_SORTED_ROWS": "1"},
            "old": {"LOOM_LORA_BASE_GRAPHS": "0", "LOOM_LORA_SORTED_ROWS": "0",
                    "LOOM_LORA_PDL": "0", "LOOM_LORA_FUSED_EXPAND": "0", "LOOM_LORA_FUSED_SHRINK": "0"}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_triton_graphs_match_merged_weights(model, adapters, variant, monkeypatch):
    for k, v in VARIANTS[variant].items():
        monkeypatch.setenv(k, v)
    per = _loras(adapters)
    with LLM(model, dtype="float32", max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=16,
             max_num_batched_tokens=1024) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False,
                            lora_request=per)
    for p, lr, o in zip(PROMPTS, per, outs):
        _check_merged_greedy_cuda(model, lr and lr.lora_path, p, list(o.outputs[0].token_ids))


@pytest.mark.parametrize("variant", ["default", "sorted-all"])
def test_bf16_graphs_match_eager(model, adapters, variant, monkeypatch):
    for k, v in VARIANTS[variant].items():
        monkeypatch.setenv(k, v)
    per = _loras(adapters)
    got = {}
    for eager in (True, False):
        with LLM(model, max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=16,
                 enforce_eager=eager) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False,
                                lora_request=per)
            got[eager] = [o.outputs[0].token_ids for o in outs]
    assert got[True] == got[False]


def test_base_only_constrained_and_penalised_steps_match_eager(model, adapters, monkeypatch):
    """Captured heads over both model graphs: base-only steps replay the base graph's grammar head
    and penalty head (captured mid-run, LOOM_PENALTY_HEAD_GRAPHS=1), a constrained step with an
    adapter row the LoRA graph's grammar head; fp32 tokens as enforce_eager's."""
    from ipc.sampling_params import StructuredOutputsParams
    monkeypatch.setenv("LOOM_PENALTY_HEAD_GRAPHS", "1")
    regex = SamplingParams(temperature=0, max_tokens=16,
                           structured_outputs=StructuredOutputsParams(regex=r"\d{2}-[xyz]{1,8}"))
    penalised = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, repetition_penalty=1.5,
                               presence_penalty=1.0, frequency_penalty=1.0)
    lora = LoRARequest("g0", 1, adapters[0])
    steps = {"grammar": (PROMPTS[:2], regex, None), "penalty": (PROMPTS[:3], penalised, None),
             "lora grammar": (PROMPTS[:2], regex, [None, lora])}
    got = {}
    for eager in (True, False):
        with LLM(model, dtype="float32", max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=16,
                 enforce_eager=eager) as llm:
            for name, (prompts, params, loras) in steps.items():
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                    lora_request=loras)
                got[eager, name] = [o.outputs[0].token_ids for o in outs]
    for name in steps:
        assert got[True, name] == got[False, name], name
