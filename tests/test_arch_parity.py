"""Every architecture Loom serves, against HF transformers: a tiny random model of each
(tests/tiny_models.py builds it from the transformers config class), greedy for 32 tokens in
float32 on the CPU through the whole engine, prompts joining while others decode. The tokens
must equal HF `generate`'s. `path` says which implementation serves it (--model-impl)."""
from __future__ import annotations

import pytest

from tests.test_engine_parity import _prompts, check_parity
from tests.tiny_models import ARCHS

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_greedy_32_tokens_match_hf(model_factory, name):
    impl = {"model_impl": "transformers"} if ARCHS[name].path == "transformers" else {}
    check_parity(model_factory(name), _prompts(300, 4, seed=1), max_new=32, block_size=4, max_num_seqs=2,
                 max_model_len=128, **impl)
