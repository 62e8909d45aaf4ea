"""Structured outputs on the GPU, in the worker process: constrained decode steps sampled by the
decode graphs' grammar head draw what the eager sampler draws (LOOM_GRAMMAR_GRAPH_HEAD=0), in
float32 on tiny random weights, with the next step's host inputs built while each waits for its
bitmask either way (workers/step_pipeline.py; the step stats' "held" phase), and every
constrained output parses under its schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from frontend import LLM
from tests.test_gpu_sampling import _first_divergence
from tests.test_structured_engine import SCHEMA, _requests

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("qwen3")


def _run(model_dir: str) -> tuple[list, dict]:
    llm = LLM(model_dir, max_model_len=256, dtype="float32", multiprocess=True)
    try:
        outs = [o.outputs[0] for o in llm.generate(*_requests(), use_tqdm=False)]
        return outs, (llm.collective_rpc("step_stats") or [None])[0] or {}
    finally:
        llm.shutdown()


def test_grammar_head_draws_what_the_eager_sampler_draws_with_steps_built_ahead(model_dir, monkeypatch):
    monkeypatch.setenv("LOOM_STEP_STATS", "1")
    monkeypatch.setenv("LOOM_GRAMMAR_GRAPH_HEAD", "1")
    head, stats = _run(model_dir)
    assert stats.get("graph", {}).get("host_ms_held", 0) > 0, stats   # steps were built ahead
    monkeypatch.setenv("LOOM_GRAMMAR_GRAPH_HEAD", "0")
    eager, stats = _run(model_dir)
    assert stats.get("graph", {}).get("host_ms_held", 0) > 0, stats
    for o in head[:3] + eager[:3]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    # (the eager sampler's logits come from another row count: cuBLAS may round fp32 sums
    # otherwise, and a near tie may part late, as test_gpu_sampling.py allows)
    for a, b in zip(head, eager):
        assert _first_divergence(a.token_ids, b.token_ids) >= min(24, len(a.token_ids), len(b.token_ids)), (a, b)
