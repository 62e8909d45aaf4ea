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
from torch import nn

transformers = pytest.importorskip("transformers")

from workers.attention import AttentionMetadata  # noqa: E402
from workers.model_loader import kv_cache_shape, load_model, model_kv_shape, safetensors_files  # noqa: E402
from workers.models.layers import RotaryEmbedding, get_rope_params  # noqa: E402
from workers.models.registry import get_model_class  # noqa: E402

ATOL = 1e-4
VOCAB = 128
BLOCK_SIZE = 4
NUM_BLOCKS = 48

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

_YARN_MODEL = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
_LONGROPE_MODEL = {"rope_type": "longrope", "original_max_position_embeddings": 2,
                   "short_factor": [1.0] * 8, "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}


def make_config(arch: str, **overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=[arch])
    cls = {"LlamaForCausalLM": transformers.LlamaConfig,
           "GraniteForCausalLM": transformers.GraniteConfig,
           "GlmForCausalLM": transformers.GlmConfig,
           "Glm4ForCausalLM": transformers.Glm4Config,
           "SmolLM3ForCausalLM": transformers.SmolLM3Config,
           "MinistralForCausalLM": transformers.MinistralConfig,
           "SeedOssForCausalLM": transformers.SeedOssConfig,
           "HeliumForCausalLM": transformers.HeliumConfig,
           "Olmo3ForCausalLM": transformers.Olmo3Config,
           "Ernie4_5ForCausalLM": transformers.Ernie4_5Config,
           "ArceeForCausalLM": transformers.ArceeConfig,
           "Exaone4ForCausalLM": transformers.Exaone4Config,
           "HyperCLOVAXForCausalLM": transformers.HyperCLOVAXConfig,
           "CwmForCausalLM": transformers.CwmConfig,
           "Ministral3ForCausalLM": transformers.Ministral3Config,
           "MistralForCausalLM": transformers.MistralConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config,
           "Qwen3ForCausalLM": transformers.Qwen3Config,
           "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
           "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
           "MixtralForCausalLM": transformers.MixtralConfig,
           "GptOssForCausalLM": transformers.GptOssConfig,
           "Olmo2ForCausalLM": transformers.Olmo2Config,
           "GemmaForCausalLM": transformers.GemmaConfig,
           "Gemma2ForCausalLM": transformers.Gemma2Config,
           "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
           "Phi3ForCausalLM": transformers.Phi3Config,
           "CohereForCausalLM": transformers.CohereConfig,
           "Cohere2ForCausalLM": transformers.Cohere2Config,
           "StableLmForCausalLM": transformers.StableLmConfig,
           "GPTNeoXForCausalLM": transformers.GPTNeoXConfig,            # the generic path's
           "GPTBigCodeForCausalLM": transformers.GPTBigCodeConfig}[arch]
    if arch == "Qwen3ForCausalLM":
        base["head_dim"] = 16
    if arch == "MistralForCausalLM":
        base["sliding_window"] = None
    if arch.startswith(("Gemma", "Cohere", "Qwen3Moe", "Qwen2Moe", "Mixtral", "GptOss")):   # the tiny models' extras (tests/tiny_models.py)
        base.update(_tiny_extra(arch))
    if arch.startswith(("Phi3", "Cohere", "StableLm")):   # their default special ids lie past the tiny vocabulary
        base.update(pad_token_id=None, eos_token_id=None, bos_token_id=None)
    base.update(overrides)
    return cls(**base)


def _tiny_extra(arch: str) -> dict:
    from tests.tiny_models import ARCHS
    return next(dict(a.extra) for a in ARCHS.values() if a.model == arch)


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
        _, kv_heads, head_dim = kv_cache_shape(model)
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
    # past original_max_position_embeddings: the scenario's sequences (3 to 12 tokens) cross 8, and
    # every HF forward is past 2 (HF's LongRoPE then uses the long factors, as our cache always does)
    "llama-yarn": ("LlamaForCausalLM", {"rope_scaling": dict(_YARN_MODEL)}),
    "llama-longrope": ("LlamaForCausalLM", {"rope_scaling": dict(_LONGROPE_MODEL)}),
    "llama-dynamic": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-bias": ("Qwen3ForCausalLM", {"attention_bias": True}),
    "granite": ("GraniteForCausalLM", {"embedding_multiplier": 3.0, "attention_multiplier": 0.1,
                                       "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "granite-biases": ("GraniteForCausalLM", {"attention_bias": True, "mlp_bias": True, "residual_multiplier": 0.3}),
    "glm": ("GlmForCausalLM", {"head_dim": 16, "pad_token_id": None, "eos_token_id": None}),
    "glm4": ("Glm4ForCausalLM", {"head_dim": 16, "pad_token_id": None, "eos_token_id": None}),
    "glm4-mha-no-bias": ("Glm4ForCausalLM", {"head_dim": 16, "num_key_value_heads": 4, "attention_bias": False,
                                             "pad_token_id": None, "eos_token_id": None}),
    "smollm3": ("SmolLM3ForCausalLM", {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1], "tie_word_embeddings": True,
                                       "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    "smollm3-biases": ("SmolLM3ForCausalLM", {"num_hidden_layers": 4, "no_rope_layer_interval": 2,
                                              "attention_bias": True, "mlp_bias": True, "pad_token_id": None,
                                              "bos_token_id": None, "eos_token_id": None}),
    "hyperclovax": ("HyperCLOVAXForCausalLM", {"embedding_multiplier": 3.0, "attention_multiplier": 0.1,
                                               "residual_multiplier": 0.5, "logits_scaling": 0.5,
                                               "attention_bias": True}),
    "hyperclovax-no-post-norm": ("HyperCLOVAXForCausalLM", {"use_post_norm": False, "residual_multiplier": 0.3}),
    "cwm": ("CwmForCausalLM", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 128,
                               "pad_token_id": None, "bos_token_id": 0, "eos_token_id": None}),
    "ministral3": ("Ministral3ForCausalLM", {"head_dim": 16, "pad_token_id": None, "bos_token_id": None,
                                             "eos_token_id": None, "rope_parameters": {
                                                 "rope_type": "default", "rope_theta": 10000.0,
                                                 "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 4}}),
    "ministral": ("MinistralForCausalLM", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 128,
                                           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "seed_oss": ("SeedOssForCausalLM", {"head_dim": 16, "attention_bias": True, "attention_out_bias": True,
                                        "mlp_bias": True, "pad_token_id": None, "bos_token_id": None,
                                        "eos_token_id": None}),
    "helium": ("HeliumForCausalLM", {"head_dim": 16, "attention_bias": True, "mlp_bias": True, "pad_token_id": None,
                                     "bos_token_id": None, "eos_token_id": None}),
    "olmo3": ("Olmo3ForCausalLM", {"num_hidden_layers": 4, "sliding_window": 128, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    "ernie4_5": ("Ernie4_5ForCausalLM", {"head_dim": 16, "use_bias": True, "pad_token_id": None, "bos_token_id": None,
                                         "eos_token_id": None}),
    "arcee": ("ArceeForCausalLM", {"attention_bias": True, "mlp_bias": True, "pad_token_id": None,
                                   "bos_token_id": None, "eos_token_id": None}),
    "exaone4": ("Exaone4ForCausalLM", {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 128,
                                       "bos_token_id": None, "eos_token_id": None}),
    "exaone4-global": ("Exaone4ForCausalLM", {"head_dim": 16, "sliding_window": None,
                                              "layer_types": ["full_attention", "full_attention"],
                                              "bos_token_id": None, "eos_token_id": None}),
    "mistral-head-dim": ("MistralForCausalLM", {"head_dim": 32}),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "olmo2-mha": ("Olmo2ForCausalLM", {"num_key_value_heads": 4}),
    "gemma": ("GemmaForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", {}),
    "gemma2-tied": ("Gemma2ForCausalLM", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "gemma3": ("Gemma3ForCausalLM", {}),
    "gemma3-local-rope": ("Gemma3ForCausalLM", {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}),
    "phi3": ("Phi3ForCausalLM", {}),
    "phi3-partial-rotary": ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "num_key_value_heads": 1}),
    "phi3-window": ("Phi3ForCausalLM", {"sliding_window": 4}),
    "phi3-longrope": ("Phi3ForCausalLM", {"rope_scaling": dict(_LONGROPE_MODEL), "original_max_position_embeddings": 2}),
    "cohere": ("CohereForCausalLM", {}),
    "cohere-qk-norm": ("CohereForCausalLM", {"use_qk_norm": True, "attention_bias": True}),
    "cohere2": ("Cohere2ForCausalLM", {}),
    "stablelm": ("StableLmForCausalLM", {"use_qkv_bias": True}),
    "stablelm-parallel-qk-norm": ("StableLmForCausalLM", {"use_parallel_residual": True, "qk_layernorm": True,
                                                          "partial_rotary_factor": 0.5}),
    # sliding windows shorter than the prompts and chunks: every layer, and layer 1 of 2
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 4}),
    "qwen2-window-layer1": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4,
                                                 "max_window_layers": 1}),
    # mixture of experts (the tiny models' configs: a dense layer, a shared expert in qwen2_moe)
    "qwen3_moe": ("Qwen3MoeForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {}),
    "mixtral": ("MixtralForCausalLM", {}),
    # sinks on both layers, layer 0's window (8) shorter than the longer prompts
    "gpt_oss": ("GptOssForCausalLM", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(case, tmp_path):
    arch, overrides = CASES[case]
    hf = make_hf_model(make_config(arch, **overrides))
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu")
    assert type(ours).__name__ == arch
    run_scenario(ours, hf)


@pytest.mark.parametrize("case", ["llama-biases", "qwen3", "gemma2"])
def test_decode_gemv_path_matches_hf(case, tmp_path, monkeypatch):
    """The layers' decode path through kernels/gemv.py (norm fused into the qkv and gate/up
    projections, SiLU into down; GeGLU's gelu runs before down): decode-sized steps take it,
    the prefills do not."""
    from kernels import gemv
    from workers.models import layers
    calls = []
    monkeypatch.setattr(layers, "gemv", lambda *a, **kw: calls.append(kw.get("prologue", "none")) or gemv.gemv(*a, **kw))
    monkeypatch.setattr(layers, "gemv_max_rows", gemv.MAX_DECODE_ROWS)
    arch, overrides = CASES[case]
    hf = make_hf_model(make_config(arch, **overrides))
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu")
    run_scenario(ours, hf)
    fused_act = set() if ours.model.layers[0].mlp.act == "gelu_tanh" else {"silu_mul"}
    assert {"none", "rms_norm", "add_rms_norm"} | fused_act <= set(calls)
    assert fused_act or "silu_mul" not in calls


@pytest.mark.parametrize("window, cap", [(None, 2.0), (4, 2.0), (4, None)])
def test_attention_module_window_and_soft_cap(window, cap):
    """workers.attention.Attention with a window and a soft cap, on the CPU path (SDPA; by hand
    where capped), against HF Gemma 2's eager attention with HF's sliding-window mask: a whole
    prompt, a chunk after a cached prefix and a decode in one step, over a shuffled, NaN-padded
    paged cache whose blocks before each window are freed (NaN too)."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from workers.attention import Attention
    hq, hkv, d, scale = 4, 2, 16, 0.3
    g = torch.Generator().manual_seed(0)
    seqs = [(11, 11), (13, 5), (10, 1)]   # (context, queries) per sequence
    keys = [torch.randn(n, hkv, d, generator=g) * 2 for n, _ in seqs]
    values = [torch.randn(n, hkv, d, generator=g) for n, _ in seqs]
    query = torch.randn(sum(q for _, q in seqs), hq, d, generator=g) * 2
    kc, vc = torch.full((NUM_BLOCKS, BLOCK_SIZE, hkv, d), float("nan")), torch.full((NUM_BLOCKS, BLOCK_SIZE, hkv, d), float("nan"))
    free = list(range(1, NUM_BLOCKS))
    random.Random(2).shuffle(free)
    tables = []
    for (n, q_len), k, v in zip(seqs, keys, values):
        blocks = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        for p in range(n):
            kc[blocks[p // BLOCK_SIZE], p % BLOCK_SIZE], vc[blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = k[p], v[p]
        if window is not None:   # a trimmed cache: blocks wholly before the first query's window point at NaN
            blocks[:max(0, n - q_len - window + 1) // BLOCK_SIZE] = [0] * (max(0, n - q_len - window + 1) // BLOCK_SIZE)
        tables.append(blocks + [0] * (4 - len(blocks)))
    qsl = [0]
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                             block_table=torch.tensor(tables, dtype=torch.int32),
                             slot_mapping=torch.zeros(0, dtype=torch.int64), max_query_len=11, max_seq_len=13)
    got = Attention(hq, hkv, d, scale, sliding_window=window, logits_soft_cap=cap)(query, (kc, vc), meta)

    class Module(nn.Module):
        num_key_value_groups = hq // hkv
    mask_fn = causal_mask_function if window is None else and_masks(causal_mask_function, sliding_window_overlay(window))
    for i, ((n, q_len), k, v) in enumerate(zip(seqs, keys, values)):
        allowed = mask_fn(0, 0, torch.arange(n - q_len, n)[:, None], torch.arange(n)[None, :])   # [Q, S]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
        want, _ = eager_attention_forward(Module().eval(), query[qsl[i]:qsl[i + 1]].transpose(0, 1)[None],
                                          k.transpose(0, 1)[None], v.transpose(0, 1)[None], bias,
                                          scaling=scale, softcap=cap)
        torch.testing.assert_close(got[qsl[i]:qsl[i + 1]], want[0].flatten(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["llama", "gpt_neox", "gpt_bigcode"])
def test_generic_path_matches_hf(case, tmp_path, monkeypatch):
    """The generic transformers path (--model-impl transformers) through the same scenario, its
    linears on the decode GEMV at decode-sized steps (randomized norms: Llama's RMSNorms run
    Loom's kernel only where they compute the same)."""
    from kernels import gemv
    from workers.models import layers
    calls = []
    monkeypatch.setattr(layers, "gemv", lambda *a, **kw: calls.append(kw.get("prologue", "none")) or gemv.gemv(*a, **kw))
    monkeypatch.setattr(layers, "gemv_max_rows", gemv.MAX_DECODE_ROWS)
    arch = {"llama": "LlamaForCausalLM", "gpt_neox": "GPTNeoXForCausalLM", "gpt_bigcode": "GPTBigCodeForCausalLM"}[case]
    hf = make_hf_model(make_config(arch))
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu", model_impl="transformers")
    assert type(ours).__name__ == "TransformersForCausalLM"
    run_scenario(ours, hf)
    assert "none" in calls


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


# rope type -> (rope_scaling, rows of the cache): each cache row must be HF's cos/sin (times its
# attention factor) at that position, from HF's rotary module run over all the rows at once
# (so that HF's per-length choice, dynamic NTK's base and LongRoPE's factors, is made at that length)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
_LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 64,
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
             "long_factor": [1.0, 1.4, 2.2, 3.5, 5.0, 7.3, 9.9, 12.5], "factor": 4.0}
ROPE_CACHE_CASES = {
    "default": (None, 256),
    "linear": ({"rope_type": "linear", "factor": 2.0}, 256),
    "dynamic-within": ({"rope_type": "dynamic", "factor": 2.0}, 256),    # HF's default base up to max_pos
    "dynamic-beyond": ({"rope_type": "dynamic", "factor": 2.0}, 400),    # the NTK base of 400 tokens
    "yarn": (_YARN, 256),
    "yarn-mscale": (dict(_YARN, mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2, truncate=False), 256),
    "yarn-attention-factor": (dict(_YARN, attention_factor=1.3), 256),
    "yarn-partial": (dict(_YARN, partial_rotary_factor=0.5), 256),
    "longrope-long": (_LONGROPE, 256),                                  # past the original 64: long factors
    "longrope-short": (_LONGROPE, 64),
    "longrope-no-factor": ({k: v for k, v in _LONGROPE.items() if k != "factor"}, 256),
    "longrope-attention-factor": (dict(_LONGROPE, attention_factor=1.1), 256),
    "llama3": (LLAMA3_ROPE, 256),
}


@pytest.mark.parametrize("case", list(ROPE_CACHE_CASES))
def test_rope_cache_matches_hf(case):
    scaling, rows = ROPE_CACHE_CASES[case]
    partial = (scaling or {}).get("partial_rotary_factor", 1.0)
    scaling = {k: v for k, v in (scaling or {}).items() if k != "partial_rotary_factor"} or None
    extra = {"partial_rotary_factor": partial} if partial != 1.0 else {}
    cfg = make_config("LlamaForCausalLM", rope_scaling=scaling, rope_theta=1000.0, **extra)
    params = get_rope_params(cfg)
    rope = RotaryEmbedding(16, rows, params)
    rot = int(16 * partial)
    assert rope.rotary_dim == rot and rope.cos_sin_cache.shape == (rows, rot)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), torch.arange(rows)[None])
    assert cos.shape[-1] == rot
    want = torch.cat((cos[0, :, :rot // 2], sin[0, :, :rot // 2]), -1)
    # past max_position_embeddings HF computes the dynamic base in float32 (from a tensor length), we in float64
    torch.testing.assert_close(rope.cos_sin_cache, want, atol=5e-5 if case == "dynamic-beyond" else 2e-6, rtol=0)
    if scaling and scaling["rope_type"] in ("yarn", "longrope"):  # the attention factor is in the cache
        assert hf_rope.attention_scaling != 1.0 and abs(float(rope.cos_sin_cache[0, 0]) - hf_rope.attention_scaling) < 1e-6


@pytest.mark.parametrize("rows", [256, 64])
def test_phi3_longrope_partial_rotary_cache_matches_hf(rows):
    """Phi-3's layout: original_max_position_embeddings beside rope_scaling (HF prefers it), no
    `factor` (the ratio of the two lengths), partial rotary; long factors past the original 64."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    cfg = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=64, partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.0, 2.0, 4.0, 8.0]})
    rope = RotaryEmbedding(16, rows, get_rope_params(cfg))
    cos, sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(rows)[None])
    assert rope.cos_sin_cache.shape == (rows, 8)
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat((cos[0, :, :4], sin[0, :, :4]), -1), atol=2e-6, rtol=0)


def test_unknown_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="'ntk-by-parts'.*default, linear, dynamic, yarn, longrope, llama3"):
        RotaryEmbedding(16, 32, {"rope_type": "ntk-by-parts", "rope_theta": 1e4})


def test_mrope_yarn_matches_hf_qwen2_5_vl():
    """Qwen2.5-VL / Qwen3-VL configs with YaRN (rope_scaling type yarn plus mrope_section): the yarn
    frequencies and attention factor, each section turned by its own row of the [3, T] positions."""
    from kernels.rotary import mrope_cos_sin
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    cfg = transformers.Qwen2_5_VLTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "mrope_section": [2, 3, 3]}, rope_theta=1000.0)
    params = get_rope_params(cfg)
    assert params["rope_type"] == "yarn"
    rope = RotaryEmbedding(16, 256, params)
    assert rope.mrope_section == (2, 3, 3)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 256, (3, 20), generator=g)
    hf_rope = Qwen2_5_VLRotaryEmbedding(cfg)
    assert hf_rope.attention_scaling != 1.0
    cos_hf, sin_hf = hf_rope(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    cos, sin = mrope_cos_sin(positions, rope.cos_sin_cache, rope.mrope_section)
    torch.testing.assert_close(cos, cos_hf[0, :, :8], atol=2e-6, rtol=0)
    torch.testing.assert_close(sin, sin_hf[0, :, :8], atol=2e-6, rtol=0)


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


def test_dummy_moe_weights_are_the_whole_drawn_tensor(tmp_path):
    """Dummy weights reach the stacked experts through their loaders (shard id None: the whole
    [E, 2I, H] / [E, H, I] tensor), every expert filled, and the model steps."""
    cfg = make_config("Qwen2MoeForCausalLM")
    cfg.save_pretrained(str(tmp_path))
    model = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")
    experts = model.model.layers[1].mlp.experts
    for p in (experts.w13_weight, experts.w2_weight):
        assert tuple(p.shape) == p.full_shape and bool((p != 0).all())
    (out,) = PagedBatch(model, cfg.num_hidden_layers).step(model, [(0, [1, 2, 3])])
    assert bool(out.isfinite().all())


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


def test_gemma_norms_store_one_plus_w_in_every_load(tmp_path):
    """Gemma's (1 + w) norms keep 1 + w: from the checkpoint, from a weight update (a partial
    load), read back as w by name, and as dummy weights (1: HF's initial w = 0)."""
    from workers.weight_update import WeightUpdater
    cfg = make_config("Gemma3ForCausalLM")
    hf = make_hf_model(cfg)
    ours = load_model(save(hf, tmp_path / "ckpt"), torch.float32, "cpu")
    for name in ("model.layers.0.pre_feedforward_layernorm.weight", "model.layers.1.self_attn.k_norm.weight",
                 "model.norm.weight"):
        torch.testing.assert_close(ours.get_parameter(name), 1 + hf.get_parameter(name))
    name = "model.layers.0.post_feedforward_layernorm.weight"
    w = torch.linspace(-0.5, 0.5, cfg.hidden_size)
    ours.load_weights([(name, w)], partial=True)
    torch.testing.assert_close(ours.get_parameter(name), 1 + w)
    from types import SimpleNamespace
    runner = SimpleNamespace(model=ours, weights_dir=str(tmp_path / "ckpt"),
                             config=SimpleNamespace(load_format="auto", weight_update_join_timeout_s=1))
    updater = WeightUpdater(runner, 0)
    torch.testing.assert_close(torch.tensor(updater.get_weights_by_name(name, 4)["values"]), w[:4])
    cfg.save_pretrained(str(tmp_path / "dummy"))
    dummy = load_model(str(tmp_path / "dummy"), torch.float32, "cpu", load_format="dummy")
    norms = [p for n, p in dummy.named_parameters() if "norm" in n]
    assert len(norms) == cfg.num_hidden_layers * 6 + 1 and all(bool((p == 1).all()) for p in norms)


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "phi3", "cohere-qk-norm", "cohere2", "stablelm-parallel-qk-norm"])
def test_dummy_weights_norms_are_one(case, tmp_path):
    """Dummy weights need only the config for every architecture; every norm's weight (RMSNorm,
    Gemma's stored 1 + w, LayerNorm, per-head LayerNorm) is 1, and a step is finite."""
    arch, overrides = CASES[case]
    cfg = make_config(arch, **overrides)
    cfg.save_pretrained(str(tmp_path))
    model = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")
    norms = [(n, p) for n, p in model.named_parameters() if "norm" in n and n.endswith(".weight")]
    assert norms and all(bool((p == 1).all()) for _, p in norms), [n for n, p in norms if not (p == 1).all()]
    (out,) = PagedBatch(model, cfg.num_hidden_layers).step(model, [(0, [1, 2, 3])])
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
    gpt2 = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' has no native implementation"):
        get_model_class(gpt2, "loom")
    assert get_model_class(gpt2).__name__ == "TransformersForCausalLM"   # auto: the generic path
    assert get_model_class(make_config("LlamaForCausalLM"), "transformers").__name__ == "TransformersForCausalLM"
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


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1}, {"tie_word_embeddings": True}])
def test_internlm2_matches_hf_llama(tmp_path, overrides):
    """InternLM2 is remote code (no transformers class): HF Llama's weights under InternLM2's
    names and per-KV-group wqkv packing (tests/tiny_models.llama_to_internlm2) must give HF
    Llama's logits."""
    from tests.tiny_models import llama_to_internlm2
    hf = make_hf_model(make_config("LlamaForCausalLM", **overrides))
    ours = load_model(llama_to_internlm2(save(hf, tmp_path / "llama"), str(tmp_path / "internlm2")),
                      torch.float32, "cpu")
    assert type(ours).__name__ == "InternLM2ForCausalLM"
    run_scenario(ours, hf)


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


def test_fused_moe_triton_path_matches_hf(tmp_path, monkeypatch):
    """The MoE layers through kernels/fused_moe.py's Triton kernels (layers.fused_moe and
    layers.select_experts on the Triton path; in the interpreter on CPU): prefills, decodes and
    chunks equal HF."""
    from kernels import fused_moe as fm
    from kernels.jit import is_interpreted
    from workers.models import layers
    if not is_interpreted(fm._fused_moe_gemm_kernel):
        pytest.skip("the Triton interpreter is not active in this process")
    calls, gemv_calls, real_gemv = [], [], fm.fused_moe_gemv
    monkeypatch.setattr(layers, "fused_moe", lambda *a, **kw: calls.append(a[0].shape[0]) or fm.fused_moe(*a, **kw))
    monkeypatch.setattr(fm, "fused_moe_gemv", lambda *a, **kw: gemv_calls.append(a[0].shape[0]) or real_gemv(*a, **kw))
    monkeypatch.setattr(layers, "select_experts", fm.fused_topk)
    hf = make_hf_model(make_config("Qwen3MoeForCausalLM"))
    ours = load_model(save(hf, tmp_path), torch.float32, "cpu")
    run_scenario(ours, hf)
    assert calls and min(calls) <= 3 < max(calls)   # decode steps and prefills both took it
    # decode-sized calls took the GEMV path, prefills the grouped GEMMs
    assert gemv_calls and max(gemv_calls) <= fm.gemv_max_tokens() < max(calls)
