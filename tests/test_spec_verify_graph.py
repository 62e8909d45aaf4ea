"""Verify steps in the decode graphs (workers/spec_decode/verify_graph.py), run uncaptured on the
CPU (LOOM_DECODE_GRAPHS_ON_CPU=1): each verify step is a decode batch of one row per token, and
it must give what the eager verify step gives: greedy output identical to decoding without
speculation, and (every row drawing as the plain sampler draws at its output index) a seeded
sampled request's output identical to its output without speculation, in the graph's head and
eagerly (logprobs make the rows sample eagerly). The test spies on the runner to check that the
verify steps did run in the graph."""
from __future__ import annotations

import json

import pytest

from ipc.sampling_params import SamplingParams
from tests.test_spec_decode import PROMPTS, STRESS

ENGINE_IN_PROCESS = True   # the engine and its worker in the test process: the spy sees the runner

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True)


def _generate(model_dir, params, **kw) -> tuple[list[list[int]], object]:
    from frontend.entrypoints.llm import LLM
    with LLM(model_dir, **STRESS, **kw) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.stats


@pytest.fixture
def graph_steps(monkeypatch):
    """Decode graphs on the CPU; counts the verify steps that run in them."""
    from workers.model_runner import ModelRunner
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    seen = {"graph": 0, "eager": 0}
    real = ModelRunner._verify_graph_size

    def spy(self, *args):
        size = real(self, *args)
        seen["graph" if size is not None else "eager"] += 1
        return size
    monkeypatch.setattr(ModelRunner, "_verify_graph_size", spy)
    return seen


def test_verify_rows_as_decodes_layout():
    """Each token its own sequence: context up to its position, its request's block table."""
    import numpy as np
    from workers.spec_decode.verify_graph import is_pure_verify, rows_as_decodes
    from workers.step_inputs import StepArrays
    num_scheduled, start = np.array([3, 1, 2]), np.array([10, 4, 7])
    host = StepArrays(input_ids=np.arange(6), positions=np.array([10, 11, 12, 4, 7, 8]),
                      slot_mapping=np.arange(6), query_start_loc=np.array([0, 3, 4, 6], np.int32),
                      seq_lens=np.array([13, 5, 9], np.int32), block_table=np.array([[1, 2], [3, 0], [4, 5]], np.int32))
    v = rows_as_decodes(host, num_scheduled, start)
    assert v.query_start_loc.tolist() == list(range(7))
    assert v.seq_lens.tolist() == [11, 12, 13, 5, 8, 9]
    assert v.block_table[:, 0].tolist() == [1, 1, 1, 3, 4, 4]
    assert v.decode_order.tolist() == [2, 1, 0, 5, 4, 3]
    assert is_pure_verify(num_scheduled, 6, np.arange(3)) and not is_pure_verify(num_scheduled, 5, np.arange(3))


def test_per_request_verify_params_equal_per_token_ones():
    """A verify step's sampling arrays built from one row per request (LOOM_SPEC_FAST_HOST) are the
    per-token rows' arrays: each request's fields, the output index advancing along its drafts."""
    import dataclasses

    import numpy as np

    from workers.sampler import Sampler, SamplingRow
    from workers.spec_decode.verify_layout import spec_layout
    from workers.spec_decode.verify_sampling import first_landings, per_token_params
    params = [SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=5)]
    prompt_len, seeds = [5, 9, 3], [11, 22, 33]
    num_scheduled, end = np.array([3, 1, 4]), np.array([12, 20, 9])
    spec = spec_layout(["a", "b", "c"], np.arange(3), end, np.concatenate(([0], np.cumsum(num_scheduled))),
                       {"a": [4, 5], "c": [7, 8, 9]})
    row = lambda i, pos: SamplingRow(params[i], seeds[i], pos - prompt_len[i], slot=i + 2)
    want = Sampler.host_params([row(j, p) for j, p in zip(spec.request.tolist(), spec.landing.tolist())])
    got = per_token_params(Sampler.host_params([row(i, p) for i, p in enumerate(first_landings(spec).tolist())]),
                           spec)
    assert len(want.seeds) == 8
    for f in dataclasses.fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        assert (a is None and b is None) or (a.dtype == b.dtype and a.tolist() == b.tolist()), f.name


@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_greedy_identical_with_verify_steps_in_decode_graphs(method, tiny_model_dir, graph_steps, tmp_path):
    want, _ = _generate(tiny_model_dir, GREEDY)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        path = tmp_path / "oracle.json"
        path.write_text(json.dumps([{"prompt_token_ids": p, "output_token_ids": o} for p, o in zip(PROMPTS, want)]))
        spec.update(oracle_path=str(path), oracle_miss_rate=0.3)
    got, stats = _generate(tiny_model_dir, GREEDY, speculative_config=spec)
    assert got == want
    assert stats.spec_num_accepted_tokens > 0 and graph_steps["graph"] > 0, graph_steps


def test_seeded_sampling_identical_with_and_without_speculation(tiny_model_dir, graph_steps, monkeypatch):
    """Each token is the plain sampler's draw at its output index: with an oracle that drafts
    the unspeculated run's own tokens, the outputs match token for token, in the graph's head,
    with logprobs (rows sampled eagerly) and with LOOM_SPEC_FULL_GRAPH=0 (piecewise verify)."""
    import tempfile
    want, _ = _generate(tiny_model_dir, SEEDED)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/oracle.json"
        with open(path, "w") as f:
            json.dump([{"prompt_token_ids": p, "output_token_ids": o} for p, o in zip(PROMPTS, want)], f)
        spec = {"method": "oracle", "num_speculative_tokens": 3, "oracle_path": path, "oracle_miss_rate": 0.2}
        got, stats = _generate(tiny_model_dir, SEEDED, speculative_config=spec)
        assert got == want and stats.spec_num_accepted_tokens > 0 and graph_steps["graph"] > 0
        with_lp = SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True, logprobs=1)
        assert _generate(tiny_model_dir, with_lp, speculative_config=spec)[0] == want
        monkeypatch.setenv("LOOM_SPEC_FULL_GRAPH", "0")
        before = graph_steps["graph"]
        assert _generate(tiny_model_dir, SEEDED, speculative_config=spec)[0] == want
        assert graph_steps["graph"] == before


def test_verify_samples_keeps_the_target_distribution():
    """10^6 requests, one draft each from a skewed q: each row's token drawn from p independently
    of the draft; the first token emitted (the draft when accepted) is distributed as p
    (chi-squared, 4 degrees of freedom, p-value > 0.01), and a draft d is accepted with p(d)."""
    import torch
    from workers.rejection_sampler import verify_samples
    n, vocab = 10 ** 6, 5
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    q = torch.tensor([0.6, 0.05, 0.05, 0.1, 0.2])
    gen = torch.Generator().manual_seed(0)
    draft = torch.multinomial(q, n, replacement=True, generator=gen)
    samples = torch.multinomial(p, 2 * n, replacement=True, generator=gen)   # row 2i: the draft's, 2i + 1: bonus
    draft_rows = torch.full((2 * n,), -1, dtype=torch.long)
    draft_rows[0::2] = draft
    v = verify_samples(samples, draft_rows, torch.arange(2 * n).view(n, 2))
    first = torch.where(v.num_accepted > 0, draft, v.tokens)
    expected = p.double() * n
    chi2 = ((torch.bincount(first, minlength=vocab).double() - expected) ** 2 / expected).sum()
    assert float(torch.special.gammaincc(torch.tensor(2.0, dtype=torch.double), chi2 / 2)) > 0.01
    assert abs(v.num_accepted.float().mean().item() - float((p * q).sum())) < 3e-3
    # a rejected draft emits its row's draw; an accepted one goes on to the bonus row's
    assert v.tokens[v.num_accepted == 1].eq(samples[1::2][v.num_accepted == 1]).all()
