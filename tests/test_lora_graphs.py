"""LoRA with the decode graphs (their work uncaptured on the CPU, LOOM_DECODE_GRAPHS_ON_CPU=1): each
size has a variant with the LoRA ops and one without (LOOM_LORA_BASE_GRAPHS); a step with an
adapter row replays the first, a base-only step the second, and both give the merged-weight
model's greedy tokens."""
from __future__ import annotations

import pytest

from frontend import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_adapter, merged_greedy

ENGINE_IN_PROCESS = True
MAX_NEW = 6
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8, 64, 12, 19, 27, 31, 4, 88, 6]]


@pytest.mark.parametrize("base_graphs", ["1", "0"])
def test_decode_graph_variants_match_merged_weights(model_factory, tmp_path, monkeypatch, base_graphs):
    from workers.decode_graphs import DecodeGraphs
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    monkeypatch.setenv("LOOM_LORA_BASE_GRAPHS", base_graphs)
    model_dir = model_factory("llama")
    adapter = make_adapter(model_dir, str(tmp_path / "a"), seed=3)
    replays = []   # (size, base variant) of every decode model replay
    run_model = DecodeGraphs.run_model

    def recording(self, bs, rows):
        replays.append((bs, self.lora_ctx is not None and not self.lora_ctx.active))
        return run_model(self, bs, rows)
    monkeypatch.setattr(DecodeGraphs, "run_model", recording)
    lora = LoRARequest("a", 1, adapter)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    with LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64, block_size=4,
             max_num_seqs=4) as llm:
        eos = llm.config.eos_token_ids
        replays.clear()   # (the capture's)
        mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                             lora_request=[None, lora])
        assert replays and not any(base for _, base in replays)   # an adapter row in every decode step
        replays.clear()
        base = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        assert replays and all(base_ for _, base_ in replays) == (base_graphs == "1")
        replays.clear()
        alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False, lora_request=lora)
        assert replays and not any(base_ for _, base_ in replays)
    assert mixed[0].outputs[0].token_ids == base[0].outputs[0].token_ids == merged_greedy(model_dir, None, PROMPTS[0],
                                                                                          MAX_NEW, eos)
    want = merged_greedy(model_dir, adapter, PROMPTS[1], MAX_NEW, eos)
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids == want
    assert want != merged_greedy(model_dir, None, PROMPTS[1], MAX_NEW, eos)   # the adapter matters


def test_base_only_constrained_and_penalised_steps_sample_in_the_base_heads(tiny_model_dir, tmp_path, monkeypatch):
    """On a LoRA engine the heads exist over both model graphs: base-only decode steps whose rows
    are constrained (the grammar head) or penalised (the penalty head, LOOM_PENALTY_HEAD_GRAPHS=1)
    replay the base graph's head, a constrained step with an adapter row the LoRA graph's; each
    draws what eager steps (enforce_eager) draw."""
    from ipc.sampling_params import StructuredOutputsParams
    from workers.decode_graphs import DecodeGraphs
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    monkeypatch.setenv("LOOM_PENALTY_HEAD_GRAPHS", "1")
    adapter = make_adapter(tiny_model_dir, str(tmp_path / "a"), seed=5)
    heads = set()   # (base, kind) of every head replay
    run_head = DecodeGraphs.run_head

    def recording(self, bs, rows, *, grammar=False, penalty_state=None):
        kind = "penalty" if penalty_state is not None else "grammar" if grammar else "plain"
        heads.add((self._base_replayed[bs], kind))
        return run_head(self, bs, rows, grammar=grammar, penalty_state=penalty_state)
    monkeypatch.setattr(DecodeGraphs, "run_head", recording)
    lora = LoRARequest("a", 1, adapter)
    regex = SamplingParams(temperature=0, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=r"\d{2}-[xyz]{1,6}"))
    penalised = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=2.0,
                               presence_penalty=2.0, frequency_penalty=2.0)
    steps = {"grammar": ([PROMPTS[0], PROMPTS[1]], regex, None), "penalty": (PROMPTS, penalised, None),
             "lora grammar": (PROMPTS, regex, [None, lora])}
    out = {}
    for eager in (True, False):
        with LLM(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64, block_size=4,
                 max_num_seqs=4, enforce_eager=eager) as llm:
            for name, (prompts, params, loras) in steps.items():
                heads.clear()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                    lora_request=loras)
                out[eager, name] = [o.outputs[0].token_ids for o in outs]
                if not eager:
                    want = {"grammar": {(True, "grammar")}, "penalty": {(True, "penalty")},
                            "lora grammar": {(False, "grammar")}}[name]
                    assert want <= heads, (name, heads)
    for name in steps:
        assert out[True, name] == out[False, name], name
    assert out[False, "lora grammar"][1] != out[False, "grammar"][1]   # the adapter matters


def test_batch_one_fuses_the_shrink_into_the_norm_and_silu(model_factory, tmp_path, monkeypatch):
    """At batch 1 through the decode GEMV, q/k/v's and gate/up's shrink run with the norm before
    them and down's with the SiLU (kernels/gemv.py lora_shrink_prologue; on the CPU its torch
    reference), the expand in the GEMV's epilogue: the merged-weight model's greedy tokens, and
    LOOM_LORA_FUSED_SHRINK=0 takes the separate kernels to the same tokens."""
    import kernels.gemv as gv
    from workers.models import layers
    # the GPU's route, the decode GEMV (torch ops on the CPU), from the runner's use_kernels("torch") on
    monkeypatch.setitem(layers._TORCH_REFERENCES, "gemv", gv.gemv)
    monkeypatch.setitem(layers._TORCH_REFERENCES, "gemv_max_rows", gv.MAX_DECODE_ROWS)
    calls = []
    shrink = gv.lora_shrink_prologue
    monkeypatch.setattr(gv, "lora_shrink_prologue", lambda x, a, slots, prologue, **kw: (
        calls.append(prologue), shrink(x, a, slots, prologue, **kw))[1])
    model_dir = model_factory("llama")
    adapter = make_adapter(model_dir, str(tmp_path / "a"), seed=5)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    lora = LoRARequest("a", 1, adapter)
    got = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("LOOM_LORA_FUSED_SHRINK", fused)
        calls.clear()
        with LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64, block_size=4,
                 max_num_seqs=4, enforce_eager=True) as llm:
            eos = llm.config.eos_token_ids
            got[fused] = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False,
                                      lora_request=lora)[0].outputs[0].token_ids
        assert bool(calls) == (fused == "1")
        if calls:
            assert {"rms_norm", "add_rms_norm", "silu_mul"} <= set(calls)
    assert got["1"] == got["0"] == merged_greedy(model_dir, adapter, PROMPTS[1], MAX_NEW, eos)
