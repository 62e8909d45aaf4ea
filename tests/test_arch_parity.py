"""Every architecture Loom serves, against HF transformers: a tiny random model of each
(tests/tiny_models.py builds it from the transformers config class), greedy for 32 tokens in
float32 on the CPU through the whole engine, prompts joining while others decode. The tokens
must equal HF `generate`'s. `path` says which implementation serves it (--model-impl)."""
from __future__ import annotations

import pytest

from frontend import LLM, SamplingParams
from tests.hf_oracle import hf_greedy
from tests.test_engine_parity import _prompts
from tests.tiny_models import ARCHS

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 32


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_greedy_32_tokens_match_hf(model_factory, name):
    model_dir = model_factory(name)
    prompts = _prompts(300, 4, seed=1)
    impl = {"model_impl": "transformers"} if ARCHS[name].path == "transformers" else {}
    llm = LLM(model_dir, block_size=4, max_num_seqs=2, max_model_len=128, **impl)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        eos = llm.config.eos_token_ids
        for p, o in zip(prompts, outs):
            ref = hf_greedy(model_dir, p, MAX_NEW, eos)
            assert o.outputs[0].token_ids == ref, f"{name}: prompt of {len(p)} tokens diverged"
    finally:
        llm.shutdown()
