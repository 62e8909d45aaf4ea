"""Our model implementations against HF transformers on the same weights.

Tiny random configs in float32 on the CPU: a varlen prefill of several prompts
in one forward, decode steps, and a chunked prefill mixed with decodes, all
through the paged KV cache, must give HF's logits on the full sequences.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from workers.attention import AttentionMetadata  # noqa: E402
from workers.model_loader import load_model, model_kv_shape, safetensors_files  # noqa: E402
from workers.models.layers import RotaryEmbedding, get_rope_params  # noqa: E402
from workers.models.registry import get_model_class  # noqa: E402

ATOL = 1e-4
VOCAB = 128
BLOCK_SIZE = 4
NUM_BLOCKS = 48

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def make_config(arch: str, **overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=[arch])
    cls = {"LlamaForCausalLM": transformers.LlamaConfig,
           "MistralForCausalLM": transformers.MistralConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config,
           "Qwen3ForCausalLM": transformers.Qwen3Config,
           "Olmo2ForCausalLM": transformers.Olmo2Config}[arch]
    if arch == "Qwen3ForCausalLM":
        base["head_dim"] = 16
    if arch == "MistralForCausalLM":
        base["sliding_window"] = None
    base.update(overrides)
    return cls(**base)


def make_hf_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # HF zero-inits biases and sets norms to one: randomize everything so that
    # biases and norm weights are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def save(model, path, **kw) -> str:
    model.save_pretrained(str(path), **kw)
    return str(path)


class PagedBatch:
    """A tiny block manager: hands out shuffled (non-contiguous) blocks and
    builds AttentionMetadata for one step."""

    def __init__(self, model, num_layers: int):
        cfg = model.config
        _, kv_heads, head_dim = model_kv_shape(cfg)
        # NaN-filled: reading a slot that was never written poisons the output.
        self.kv_caches = [(torch.full((NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim), float("nan")),
                           torch.full((NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim), float("nan")))
                          for _ in range(num_layers)]
        self.free = list(range(NUM_BLOCKS))
        random.Random(1).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, model, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (seq_id, new token ids) per sequence. Returns the logits of
        each sequence's new tokens."""
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(sid, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            for p in range(start, end):
                slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            ids += toks
            pos += range(start, end)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(blocks)
            self.lens[sid] = end
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(pos), self.kv_caches, meta)
            assert hidden.shape == (len(ids), model.config.hidden_size)
            logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return [logits[qsl[i]:qsl[i + 1]] for i in range(len(chunks))]


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def check_prefill(ours, hf, prompts: list[list[int]], batch: "PagedBatch | None" = None) -> "PagedBatch":
    """Prefill every prompt in one step of `batch` (a fresh one if None); logits match HF's."""
    batch = batch or PagedBatch(ours, ours.config.num_hidden_layers)
    outs = batch.step(ours, list(enumerate(prompts)))
    for prompt, out in zip(prompts, outs):
        ref = hf_logits(hf, prompt)
        torch.testing.assert_close(out[-1], ref[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    return batch


def run_scenario(ours, hf, seed: int = 0) -> None:
    """Prefill 3 prompts in one step, 3 decode steps, then a 4th prompt in two
    chunks, each chunk batched with decodes of the others: every logit equals HF's."""
    for out, tokens, rows in scenario_logits(ours, seed):
        ref = hf_logits(hf, tokens)[rows]
        torch.testing.assert_close(out[-1], ref[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def scenario_logits(ours, seed: int = 0):
    """run_scenario's steps on `ours` alone (tests/test_arch_tp.py runs them on every rank of a
    group): yields (our logits of `rows` of the sequence `tokens`) for every sequence of every step."""
    rng = random.Random(seed)
    vocab = ours.config.vocab_size
    batch = PagedBatch(ours, ours.config.num_hidden_layers)
    seqs = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 9, 3)]
    for seq, out in zip(seqs, batch.step(ours, list(enumerate(seqs)))):
        yield out, list(seq), slice(None)

    def decode_all(extra=()):
        new = [rng.randrange(vocab) for _ in seqs]
        for seq, tok in zip(seqs, new):
            seq.append(tok)
        outs = batch.step(ours, [(i, [tok]) for i, tok in enumerate(new)] + list(extra))
        for seq, out in zip(seqs, outs):
            assert out.shape == (1, vocab)
        return [(out, list(seq), slice(-1, None)) for seq, out in zip(seqs, outs)], outs[len(seqs):]

    for _ in range(3):
        yield from decode_all()[0]

    long_prompt = [rng.randrange(vocab) for _ in range(11)]
    for rows in (slice(0, 6), slice(6, 11)):
        decodes, (chunk,) = decode_all([(3, long_prompt[rows])])
        yield from decodes
        yield chunk, long_prompt, rows


CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_scaling": dict(LLAMA3_ROPE), "rope_theta": 500000.0}),
    "llama-biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-bias": ("Qwen3ForCausalLM", {"attention_bias": True}),
    "mistral-head-dim": ("MistralForCausalLM", {"head_dim": 32}),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "olmo2-mha": ("Olmo2ForCausalLM", {"num_key_value_heads": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(case, tmp_path):
    arch, overrides = CASES[case]
    hf = make_hf_model(make_config(arch, **overrides))
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu")
    assert type(ours).__name__ == arch
    run_scenario(ours, hf)


@pytest.mark.parametrize("case", ["llama-biases", "qwen3"])
def test_decode_gemv_path_matches_hf(case, tmp_path, monkeypatch):
    """The layers' decode path through kernels/gemv.py (norm fused into the qkv and gate/up
    projections, SiLU into down): decode-sized steps take it, the prefills do not."""
    from kernels import gemv
    from workers.models import layers
    calls = []
    monkeypatch.setattr(layers, "gemv", lambda *a, **kw: calls.append(kw.get("prologue", "none")) or gemv.gemv(*a, **kw))
    monkeypatch.setattr(layers, "gemv_max_rows", gemv.MAX_DECODE_ROWS)
    arch, overrides = CASES[case]
    hf = make_hf_model(make_config(arch, **overrides))
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu")
    run_scenario(ours, hf)
    assert {"none", "rms_norm", "add_rms_norm", "silu_mul"} <= set(calls)


def test_qwen2_has_qkv_bias_only(tmp_path):
    hf = make_hf_model(make_config("Qwen2ForCausalLM"))
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu")
    attn = ours.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    torch.testing.assert_close(attn.qkv_proj.bias[:attn.q_size], hf.model.layers[0].self_attn.q_proj.bias)


def test_llama3_rope_cache_matches_hf():
    cfg = make_config("LlamaForCausalLM", rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0)
    params = get_rope_params(cfg)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    rope = RotaryEmbedding(16, 256, params)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    pos = torch.arange(256)[None]
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat((cos[0, :, :8], sin[0, :, :8]), -1))


def test_rope_params_old_and_new_layouts():
    class Old:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    p = get_rope_params(Old())
    assert p["rope_theta"] == 1234.0 and p["rope_type"] == "linear" and p["factor"] == 2.0

    class New:
        rope_parameters = {"rope_theta": 99.0, "rope_type": "default"}

    assert get_rope_params(New())["rope_theta"] == 99.0

    class Bare:
        pass

    assert get_rope_params(Bare()) == {"rope_theta": 10000.0, "rope_type": "default"}


def test_sharded_checkpoint(tmp_path):
    hf = make_hf_model(make_config("LlamaForCausalLM"), seed=3)
    path = save(hf, tmp_path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    files = safetensors_files(path)
    assert len(files) > 1 and files == sorted(files)
    ours = load_model(path, torch.float32, "cpu")
    check_prefill(ours, hf, [[1, 2, 3, 4, 5, 6], [7, 8, 9]])


def test_tied_embeddings(tmp_path):
    hf = make_hf_model(make_config("Qwen2ForCausalLM", tie_word_embeddings=True), seed=4)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    check_prefill(ours, hf, [[5, 6, 7, 8], [9, 10]])


def test_tied_checkpoint_with_lm_head_is_accepted(tmp_path):
    cfg = make_config("LlamaForCausalLM", tie_word_embeddings=True)
    hf = make_hf_model(cfg)
    weights = [(k, v.clone()) for k, v in hf.state_dict().items()]
    if "lm_head.weight" not in dict(weights):
        weights.append(("lm_head.weight", hf.lm_head.weight.detach().clone()))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(weights)


def _fresh(cfg):
    return get_model_class(cfg)(cfg)


def test_duplicate_unexpected_and_missing_weights():
    cfg = make_config("LlamaForCausalLM")
    hf = make_hf_model(cfg)
    sd = list(hf.state_dict().items())
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _fresh(cfg).load_weights(sd + [(name, dict(sd)[name])])
    with pytest.raises(ValueError, match="bogus"):
        _fresh(cfg).load_weights(sd + [("model.bogus.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"qkv_proj\.weight\[v\]"):
        _fresh(cfg).load_weights([(k, v) for k, v in sd if k != "model.layers.0.self_attn.v_proj.weight"])
    with pytest.raises(ValueError, match="lm_head"):
        _fresh(cfg).load_weights([(k, v) for k, v in sd if k != "lm_head.weight"])
    with pytest.raises(ValueError, match="shape"):
        _fresh(cfg).load_weights([(k, v[:-1] if k == "model.norm.weight" else v) for k, v in sd])
    # HF's rotary buffer is ignored.
    _fresh(cfg).load_weights(sd + [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


def test_dummy_load_needs_only_config(tmp_path):
    cfg = make_config("Qwen3ForCausalLM")
    cfg.save_pretrained(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json"]
    a = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")
    b = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
        if "norm" in na:
            assert bool((pa == 1).all()), na
        else:
            assert pa.abs().max() <= 1e-3 and pa.abs().max() > 0, na
    batch = PagedBatch(a, cfg.num_hidden_layers)
    (out,) = batch.step(a, [(0, [1, 2, 3])])
    assert torch.isfinite(out).all()


def test_bf16_build(tmp_path):
    cfg = make_config("LlamaForCausalLM")
    cfg.save_pretrained(str(tmp_path))
    m = load_model(str(tmp_path), torch.bfloat16, "cpu", load_format="dummy")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    assert not any(p.requires_grad for p in m.parameters())


def test_registry_and_kv_shape():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        get_model_class(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="architectures"):
        get_model_class(transformers.LlamaConfig())
    assert model_kv_shape(make_config("LlamaForCausalLM")) == (2, 2, 16)
    assert model_kv_shape(make_config("MistralForCausalLM", head_dim=32)) == (2, 2, 32)
    assert model_kv_shape(make_config("Qwen3ForCausalLM", num_key_value_heads=None)) == (2, 4, 16)


def test_missing_checkpoint_and_bad_format(tmp_path):
    make_config("LlamaForCausalLM").save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path), torch.float32, "cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), torch.float32, "cpu", load_format="pt")
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


def test_olmo2_greedy_matches_hf(model_factory):
    """OLMo-2 (post-norms, q/k norms over the whole projection) through the whole engine:
    greedy tokens equal HF's, in float32, prompts joining the batch while others decode."""
    from tests.test_engine_parity import _prompts, check_parity
    check_parity(model_factory("olmo2"), _prompts(300), block_size=4, max_num_seqs=2, max_model_len=128)


def test_olmo2_tensor_parallel_matches_hf(model_factory):
    """At TP=2 with one KV head (replicated on both ranks): the q/k norms add the ranks' sums of
    squares, and the greedy tokens still equal HF's."""
    from tests.test_engine_parity import _prompts, check_parity
    check_parity(model_factory("olmo2", num_key_value_heads=1), _prompts(300, 3), tensor_parallel_size=2,
                 block_size=4, max_num_seqs=2, max_model_len=128)


def test_registry_multimodal_flags_match_the_classes():
    """The registry's `multimodal` flag (which lets the launcher skip importing text-only model
    files) agrees with what each class declares."""
    from workers.models.interfaces import supports_multimodal
    from workers.models.registry import MODELS, model_class
    for arch, entry in MODELS.items():
        cls = model_class(arch)
        assert cls.__name__ == arch
        assert supports_multimodal(cls) == entry.multimodal, arch
        assert all(hasattr(cls, a) for a in ("forward", "compute_logits", "hf_to_loom", "load_weights")), arch


def test_no_model_type_branch_outside_the_models():
    """The engine asks the model's declarations: outside workers/models/ and multimodal/ no code
    reads a config's model_type (the demo-model builder writes one into a config.json)."""
    import ast
    from tests.conftest import ROOT
    found = []
    for pkg in ("engine_core", "frontend", "ipc", "workers", "kernels", "metrics", "shm", "multimodal"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            rel = os.path.relpath(dirpath, ROOT)
            if rel.startswith(os.path.join("workers", "models")):
                continue
            for f in files:
                if not f.endswith(".py"):
                    continue
                tree = ast.parse(open(os.path.join(dirpath, f)).read())
                for node in ast.walk(tree):
                    reads = (isinstance(node, ast.Attribute) and node.attr == "model_type"
                             and isinstance(node.ctx, ast.Load))
                    reads |= isinstance(node, ast.Constant) and node.value == "model_type"
                    if reads:
                        found.append(f"{rel}/{f}")
    # the only mentions: the demo builder writing its config, the processor hashing it into item keys
    assert set(found) == {"frontend/tools/demo_model.py", "multimodal/processor.py"}, found
