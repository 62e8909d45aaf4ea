"""EAGLE-1 and EAGLE-3 speculative decoding (--speculative-config method eagle / eagle3): heads in
the public checkpoint layouts (EAGLE-1's pytorch_model.bin, EAGLE-3's midlayer with d2t, the
speculators format); the serving head (paged KV) against a plain-torch reference of the EAGLE
math; greedy output identical with and without the head under chunked prefill, prefix caching
and preemption; a seeded request reproduces; a JSON-schema request stays valid; a head trained
on the demo model's hidden states reaches a mean acceptance length >= 2 on the Zen prompts."""
from __future__ import annotations

import json

import pytest
import torch

from ipc.config import ConfigError, EngineConfig
from ipc.sampling_params import SamplingParams, StructuredOutputsParams
from tests.eagle_heads import write_head
from tests.test_spec_decode import GREEDY, PROMPTS, SCHEMA, STRESS, ZEN, _generate

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    outs, stats = _generate(tiny_model_dir)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return [o.token_ids for o in outs]


def _head(kind: str, target_dir: str, out_dir: str) -> tuple[str, str]:
    """(method, head dir) for a test kind: eagle (EAGLE-1, .bin), eagle3 (a draft vocabulary of
    half the target's: d2t maps it), eagle3-speculators (explicit auxiliary layers)."""
    method = kind.split("-")[0]
    with open(f"{target_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    if kind == "eagle3-speculators":
        return method, write_head(out_dir, target_dir, method, seed=1, layout="speculators", aux_layers=[1, 0, 1])
    return method, write_head(out_dir, target_dir, method, draft_vocab=vocab // 2 if method == "eagle3" else None)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-speculators", "eagle3-disable"])
def test_greedy_identical_with_eagle(kind, tiny_model_dir, baseline, tmp_path):
    """eagle3-disable: no drafts while 3 or more requests run (the head still runs over every
    step's tokens, so its KV is whole when speculation resumes as the batch shrinks)."""
    method, head = _head(kind.replace("-disable", ""), tiny_model_dir, str(tmp_path / "head"))
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    if kind.endswith("disable"):
        spec["disable_by_batch_size"] = 3
    outs, stats = _generate(tiny_model_dir, speculative_config=spec)
    assert [o.token_ids for o in outs] == baseline
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # k drafts per decoding step of every request (fewer near max_tokens; a random head: few accepted)
    assert stats.spec_num_drafts > (10 if kind.endswith("disable") else 50)
    assert stats.spec_num_draft_tokens > 2.5 * stats.spec_num_drafts


def record_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(a request's tokens, the drafts the head proposed after them) for every proposal of the
    in-process engine's EagleProposer."""
    from workers.spec_decode.eagle import EagleProposer
    records, propose = [], EagleProposer.propose

    def recording(self, runner, states, step):
        out = propose(self, runner, states, step)
        records.extend((runner.batch.token_ids[st.slot, :st.num_tokens].tolist(), out[st.req_id])
                       for st in states if st.req_id in out)
        return out
    monkeypatch.setattr(EagleProposer, "propose", recording)
    return records


def reference_drafts(target_dir: str, head_dir: str, method: str, records, aux_layers=(1, 1, 0)) -> list[list[int]]:
    """The drafts EagleReference gives after each recorded token sequence T: the HF target's
    hidden states (or auxiliary streams) over T[:-1], then the head unrolled over k passes fed
    the recorded drafts (so that each draft is checked on its own)."""
    from transformers import AutoModelForCausalLM

    from frontend.tools.demo_eagle import EagleReference
    cfg = json.load(open(f"{target_dir}/config.json"))
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tensors = {k.replace("layers.0.", "midlayer.") if method == "eagle3" else k: v
               for k, v in _checkpoint(head_dir).items()}
    ref = EagleReference(cfg, method, tensors["lm_head.weight"].shape[0] if method == "eagle3" else None)
    ref.load_checkpoint(tensors)
    embed, lm_head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    out = []
    with torch.no_grad():
        for tokens, drafts in records:
            n, k = len(tokens), len(drafts)
            states = hf.model(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=method == "eagle3")
            hidden = (ref.combine(torch.cat([states.hidden_states[i][0] for i in aux_layers], -1)) if method == "eagle3"
                      else states.last_hidden_state[0])
            hidden = torch.cat((hidden, hidden.new_zeros(k - 1, hidden.shape[-1])))
            passes = ref.unrolled(embed[torch.tensor(tokens[1:] + drafts[:-1])][None], hidden[None], k)
            out.append([int(ref.logits(rows[0, n - 2 + m], lm_head).argmax()) for m, (rows, _) in enumerate(passes)])
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-graphs", "eagle-graphs"])
def test_engine_drafts_are_the_reference_drafts(kind, tiny_model_dir, tmp_path, monkeypatch):
    """Every draft the engine's head proposed (under chunked prefill, a 16-token budget, and
    preemption) is the one the torch reference computes from the HF target's hidden states over
    the request's tokens: the next-token shift, the chunk ends, the accepted rows and the draft
    steps' positions and KV are right. (The prompts share no prefix: a prefix-cached block's last
    position holds the head's KV for the next token of the request that computed it, as in vLLM.)
    eagle3-graphs: the decode graphs' and the draft graphs' work, uncaptured on the CPU (their
    static buffers, padding rows and the auxiliary copies inside the target's graph)."""
    if kind.endswith("graphs"):
        monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    method, head = _head(kind.replace("-graphs", ""), tiny_model_dir, str(tmp_path / "head"))
    records = record_drafts(monkeypatch)
    prompts = PROMPTS[2:] + [list(range(200, 236)), [5, 3, 5, 8, 9, 7, 9, 3] * 3]
    _, stats = _generate(tiny_model_dir, prompts=prompts, speculative_config={"method": method, "model": head,
                                                                              "num_speculative_tokens": 3})
    assert stats.num_preemptions > 0 and len(records) > 100
    sample = records[::4]
    assert [d for _, d in sample] == reference_drafts(tiny_model_dir, head, method, sample)


def _paged_meta(start: int, n: int, block_size: int = 16):
    """One sequence's attention metadata for tokens start .. start + n - 1 (blocks 0, 1, ...)."""
    from workers.attention import AttentionMetadata
    end = start + n
    return AttentionMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([end], dtype=torch.int32),
                             torch.arange(-(-end // block_size), dtype=torch.int32)[None],
                             torch.arange(start, end), max_query_len=n, max_seq_len=end, backend="torch",
                             num_decodes=int(n == 1))


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-speculators"])
def test_head_matches_the_torch_reference(kind, model_factory, tmp_path):
    """The serving head over 20 tokens (a prefill into its paged cache), then one draft step fed
    its own output, against EagleReference (whole sequences, masks, no cache): the rows for the
    lm_head, the next hidden states, and the drafts (EAGLE-3's mapped through d2t)."""
    from frontend.tools.demo_eagle import EagleReference
    from workers.model_loader import load_model
    from workers.models.llama_eagle import load_eagle_head
    target_dir = model_factory("llama")
    method, head_dir = _head(kind, target_dir, str(tmp_path / "head"))
    target = load_model(target_dir, torch.float32, "cpu")
    head = load_eagle_head(head_dir, method, target, torch.float32, "cpu")
    cfg = json.load(open(f"{target_dir}/config.json"))
    tensors = {k.replace("layers.0.", "midlayer.") if method == "eagle3" else k: v for k, v in
               _checkpoint(head_dir).items()}
    ref = EagleReference(cfg, method, tensors["lm_head.weight"].shape[0] if method == "eagle3" else None,
                         norm_before_residual=kind.endswith("speculators"))
    ref.load_checkpoint(tensors)
    g = torch.Generator().manual_seed(0)
    n, h = 20, cfg["hidden_size"]
    tokens = torch.randint(cfg["vocab_size"], (n + 2,), generator=g)
    feats = torch.randn(n, 3 * h if method == "eagle3" else h, generator=g)
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    kv = (torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))
    with torch.inference_mode():
        hidden = head.combine(feats) if method == "eagle3" else feats
        rows, nxt = head(tokens[1:n + 1], torch.arange(n), hidden, kv, _paged_meta(0, n))
        drafts = head.draft_tokens(rows)
        rows2, nxt2 = head(drafts[-1:], torch.tensor([n]), nxt[-1:], kv, _paged_meta(n, 1))
        draft2 = head.draft_tokens(rows2)
    with torch.no_grad():
        seq = torch.cat((tokens[1:n + 1], drafts[-1:]))
        ref_hidden = ref.combine(feats) if method == "eagle3" else feats
        (r_rows, r_nxt), (r_rows2, r_nxt2) = ref.unrolled(embed[seq][None], torch.cat(
            (ref_hidden, torch.zeros(1, h)))[None], 2)
    torch.testing.assert_close(rows, r_rows[0, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nxt, r_nxt[0, :n], rtol=1e-4, atol=1e-4)
    assert drafts.tolist() == ref.logits(r_rows[0, :n], lm_head).argmax(-1).tolist()
    torch.testing.assert_close(rows2, r_rows2[0, n:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nxt2, r_nxt2[0, n:], rtol=1e-4, atol=1e-4)
    assert draft2.tolist() == ref.logits(r_rows2[0, n:], lm_head).argmax(-1).tolist()
    if kind == "eagle3":   # drafts are target ids in the draft vocabulary (half the target's)
        vocab_ids = set((torch.arange(len(head.d2t)) + head.d2t).tolist())
        assert set(drafts.tolist()) <= vocab_ids and len(vocab_ids) < cfg["vocab_size"]


def _checkpoint(head_dir: str) -> dict[str, torch.Tensor]:
    import os

    from safetensors.torch import load_file
    path = os.path.join(head_dir, "model.safetensors")
    return load_file(path) if os.path.exists(path) else torch.load(os.path.join(head_dir, "pytorch_model.bin"),
                                                                   weights_only=True)


def test_eagle3_aux_states_are_the_streams_entering_the_layers(model_factory):
    """AuxHiddenStates' hooks capture the residual stream entering each auxiliary layer: HF's
    hidden_states[i] on the same weights (its embeddings for layer 0)."""
    from transformers import AutoModelForCausalLM

    from workers.model_loader import load_model
    from workers.spec_decode.eagle import AuxHiddenStates
    target_dir = model_factory("llama")
    model = load_model(target_dir, torch.float32, "cpu")
    aux = AuxHiddenStates(model.model.layers, (1, 0, 1), 32, 64, torch.float32, torch.device("cpu"))
    ids = torch.arange(3, 15)
    kv = [(torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)) for _ in range(2)]
    with torch.inference_mode():
        model(ids, torch.arange(12), kv, _paged_meta(0, 12))
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[1][0], states[0][0], states[1][0]], -1)
    torch.testing.assert_close(aux.buffer[:12], want, rtol=1e-4, atol=1e-4)


def test_eagle3_on_llava_matches_hf(tmp_path):
    """EAGLE-3 on a LLaVA target (the auxiliary streams of its language model), prompts with and
    without images: greedy output is HF's."""
    from tests.test_llava_parity import CASES, _check
    from tests.tiny_vl_models import make_tiny_llava
    target = make_tiny_llava(str(tmp_path / "llava"), tower="clip")
    head = write_head(str(tmp_path / "head"), target, "eagle3")
    _check(target, CASES, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})


def test_seeded_request_reproduces_with_eagle3(tiny_model_dir, tmp_path):
    method, head = _head("eagle3", tiny_model_dir, str(tmp_path / "head"))
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=1)
    a, _ = _generate(tiny_model_dir, params, PROMPTS[:3], speculative_config=spec)
    b, stats = _generate(tiny_model_dir, params, PROMPTS[:3], speculative_config=spec)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert stats.spec_num_drafts > 0
    for o in a:
        assert len(o.logprobs) == len(o.token_ids) and all(t in lp for t, lp in zip(o.token_ids, o.logprobs))


def test_json_schema_stays_valid_with_eagle(tiny_model_dir, tmp_path):
    import jsonschema
    method, head = _head("eagle", tiny_model_dir, str(tmp_path / "head"))
    params = [SamplingParams(temperature=t, seed=s, max_tokens=100,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)) for t, s in ((0.0, 0), (1.0, 1))]
    outs, stats = _generate(tiny_model_dir, params, ["Tell me", "a story"],
                            speculative_config={"method": method, "model": head, "num_speculative_tokens": 3})
    for o in outs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert stats.spec_num_drafts > 0


@pytest.mark.parametrize("spec, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "eagle needs"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "/nonexistent"}, "eagle3 needs"),
])
def test_bad_eagle_configs_are_config_errors(spec, words, tiny_model_dir):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(model=tiny_model_dir, speculative_config=spec).resolve()


def test_head_of_another_hidden_size_is_refused(tiny_model_dir, model_factory, tmp_path):
    from workers.model_loader import load_model
    from workers.models.llama_eagle import load_eagle_head
    other = model_factory("llama", hidden_size=32, intermediate_size=64)
    head = write_head(str(tmp_path / "head"), other, "eagle")
    with pytest.raises(ValueError, match="hidden size"):
        load_eagle_head(head, "eagle", load_model(tiny_model_dir, torch.float32, "cpu"), torch.float32, "cpu")


@pytest.mark.slow   # two worker processes: ~15 s
def test_tensor_parallel_eagle3_identical(tiny_model_dir, baseline, tmp_path):
    """TP=2 on gloo: the head runs sharded on every rank (its q/k/v and MLP split like the
    target's, fc replicated), the target's greedy output unchanged."""
    from frontend.entrypoints.llm import LLM
    method, head = _head("eagle3", tiny_model_dir, str(tmp_path / "head"))
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    with LLM(tiny_model_dir, multiprocess=True, tensor_parallel_size=2, speculative_config=spec, **STRESS) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
        assert llm.stats.spec_num_drafts > 0
    assert got == baseline[:2]


# the demo head's training budget: optimizer steps (deterministic), ~20 s of CPU (40 steps: 2.24 measured)
DEMO_STEPS = dict(steps=60, batch=8, window=48)


@pytest.fixture(scope="session")
def demo_eagle_dir(demo_model_dir, tmp_path_factory) -> str:
    from frontend.tools.demo_eagle import train_demo_eagle
    out = str(tmp_path_factory.mktemp("demo-eagle"))
    train_demo_eagle(demo_model_dir, out, **DEMO_STEPS)
    return out


def test_eagle_head_reaches_acceptance_length_2_on_the_demo_model(demo_model_dir, demo_eagle_dir, monkeypatch):
    """An EAGLE-1 head trained on the demo model's hidden states (frontend/tools/demo_eagle.py,
    a tight step budget) drafts for it on the Zen prompts: greedy output unchanged, mean
    acceptance length >= 2 from the engine's spec_decode stats (what vllm:spec_decode_* count);
    its drafts after verify steps that accepted some are the torch reference's too."""
    from frontend.entrypoints.llm import LLM
    spec = {"method": "eagle", "model": demo_eagle_dir, "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=48, temperature=0)
    with LLM(demo_model_dir, max_model_len=256) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(ZEN, params, use_tqdm=False)]
    records = record_drafts(monkeypatch)
    with LLM(demo_model_dir, max_model_len=256, speculative_config=spec) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(ZEN, params, use_tqdm=False)]
        stats = llm.stats
    assert got == want
    assert stats.mean_acceptance_length >= 2.0, (stats.mean_acceptance_length, stats.spec_accepted_per_pos)
    sample = records[::5]
    same = sum(a == b for (_, a), b in zip(sample, reference_drafts(demo_model_dir, demo_eagle_dir, "eagle", sample)))
    assert same >= 0.9 * len(sample), (same, len(sample))   # (a trained head's near ties may round either way)
