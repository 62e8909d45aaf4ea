"""Pooling on the GPU (issue 48 item 3): the Triton kernels, piecewise CUDA graphs and the pooler's
device-side indices, against HF transformers in float32 on the same tiny random weights. Mean
pooling runs across prefill chunks (a small step budget); the reranker's conversion in bfloat16."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world! How are you today?", "The quick brown fox jumps over the lazy dog. " * 6,
           "Simple is better than complex."] * 8


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("pooling_type,dtype", [("LAST", "bfloat16"), ("MEAN", "bfloat16"), ("LAST", "float32")])
def test_gpu_pooling_matches_hf(tiny_model_dir, pooling_type, dtype):
    from transformers import AutoModel, AutoTokenizer

    from frontend import LLM
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with LLM(tiny_model_dir, runner="pooling", dtype=dtype, max_model_len=256, max_num_seqs=8,
             max_num_batched_tokens=64, pooler_config={"pooling_type": pooling_type}) as llm:
        outs = llm.embed(PROMPTS, use_tqdm=False)
    hf = AutoModel.from_pretrained(tiny_model_dir).eval()
    floor = 0.9999 if dtype == "float32" else 0.999
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            hidden = hf(torch.tensor([tok(prompt)["input_ids"]])).last_hidden_state[0]
        want = hidden[-1] if pooling_type == "LAST" else hidden.mean(0)
        assert _cos(out.outputs.embedding, want.numpy()) >= floor
