"""Tiny random Hugging Face checkpoints (with a locally trained tokenizer) for tests."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

_TEXT = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
         "complex. Complex is better than complicated. Flat is better than nested. Sparse is better "
         "than dense. Readability counts. The quick brown fox jumps over the lazy dog. 0123456789 "
         "Hello world! How are you today? Tell me a story about a cat and a dog.")

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(out_dir: str, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


class TinyArch(NamedTuple):
    config: str            # the transformers config class
    model: str             # the transformers model class (config.json's `architectures[0]`)
    extra: dict            # config overrides that make the tiny model exercise the architecture
    path: str = "loom"     # what serves it: Loom's own file ("loom") or the generic path ("transformers")


# name -> the architecture's tiny model; tests/test_arch_parity.py checks each against HF
ARCHS: dict[str, TinyArch] = {
    "llama": TinyArch("LlamaConfig", "LlamaForCausalLM", {}),
    "granite": TinyArch("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 3.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "glm": TinyArch("GlmConfig", "GlmForCausalLM", {"head_dim": 16}),
    "glm4": TinyArch("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}),
    "smollm3": TinyArch("SmolLM3Config", "SmolLM3ForCausalLM", {"tie_word_embeddings": True, "num_hidden_layers": 4,
                                                                "no_rope_layer_interval": 2}),
    # sliding layers 0 and 2, full 1 and 3; the window above the prompts until the kernels take it
    "ministral": TinyArch("MinistralConfig", "MinistralForCausalLM", {
        "head_dim": 16, "num_hidden_layers": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}),
    "seed_oss": TinyArch("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 16, "attention_bias": True,
                                                                  "attention_out_bias": True}),
    "helium": TinyArch("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16, "attention_bias": True}),
    # sliding layers 0, 1 and 3 with their own rope theta, full layer 2
    "olmo3": TinyArch("Olmo3Config", "Olmo3ForCausalLM", {
        "num_hidden_layers": 4, "sliding_window": 128,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    "ernie4_5": TinyArch("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16, "use_bias": True}),
    "arcee": TinyArch("ArceeConfig", "ArceeForCausalLM", {}),
    # local layers 0, 1 and 2 (rotary), global layer 3 (no positions)
    "exaone4": TinyArch("Exaone4Config", "Exaone4ForCausalLM", {"head_dim": 16, "num_hidden_layers": 4,
                                                                "sliding_window": 128}),
    # Llama 4's query temperature from position 16 on (YaRN, the released rope, is h44-rope's)
    "ministral3": TinyArch("Ministral3Config", "Ministral3ForCausalLM", {"head_dim": 16, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
        "original_max_position_embeddings": 16}}),
    "hyperclovax": TinyArch("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {
        "embedding_multiplier": 3.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5, "logits_scaling": 0.5}),
    # full layers 0 and 2, sliding 1 and 3; llama3 rope scaling
    "cwm": TinyArch("CwmConfig", "CwmForCausalLM", {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 128,
                                                    "bos_token_id": 0,   # an int, the config insists
                                                    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0,
                                                                        "factor": 8.0, "low_freq_factor": 1.0,
                                                                        "high_freq_factor": 4.0,
                                                                        "original_max_position_embeddings": 64}}),
    "qwen2": TinyArch("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": TinyArch("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": TinyArch("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": None}),
    # mixture of experts: layer 1 of qwen3_moe is dense (mlp_only_layers), layer 0 of qwen2_moe too (sparse step 2)
    "qwen3_moe": TinyArch("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": TinyArch("MixtralConfig", "MixtralForCausalLM", {
        "head_dim": 16, "sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 32}),
    "qwen2_moe": TinyArch("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2, "norm_topk_prob": False}),
    # sliding layer 0 (a window shorter than the prompts and generations) and full layer 1, both
    # with sinks; YaRN rope, biased experts with the clamped SwiGLU, a biased router
    "gpt_oss": TinyArch("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 16, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 32}),
    "olmo2": TinyArch("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma": TinyArch("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    # sliding layers 0 and 2, global 1 and 3; windows shorter than the prompts and generations;
    # soft caps low enough to bite
    "gemma2": TinyArch("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "num_hidden_layers": 4, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0}),
    "gemma3": TinyArch("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "num_hidden_layers": 4, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    "phi3": TinyArch("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "sliding_window": 12}),
    "cohere": TinyArch("CohereConfig", "CohereForCausalLM", {"tie_word_embeddings": True, "logit_scale": 0.5,
                                                             "use_qk_norm": True}),
    # local layers 0, 1 and 3 (rotary), global layer 2 (no positions)
    "cohere2": TinyArch("Cohere2Config", "Cohere2ForCausalLM", {
        "tie_word_embeddings": True, "logit_scale": 0.5, "num_hidden_layers": 4, "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]}),
    "stablelm": TinyArch("StableLmConfig", "StableLmForCausalLM", {"use_qkv_bias": True, "qk_layernorm": True}),
    # the generic transformers path (workers/models/transformers.py): no native file
    "gpt_neox": TinyArch("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}, "transformers"),
    "starcoder2": TinyArch("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": None}, "transformers"),
    "phi": TinyArch("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}, "transformers"),
    "gptj": TinyArch("GPTJConfig", "GPTJForCausalLM", {"rotary_dim": 8}, "transformers"),
    "gpt_bigcode": TinyArch("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"multi_query": True}, "transformers"),
    "olmo": TinyArch("OlmoConfig", "OlmoForCausalLM", {}, "transformers"),
    "persimmon": TinyArch("PersimmonConfig", "PersimmonForCausalLM", {}, "transformers"),
    "nanochat": TinyArch("NanoChatConfig", "NanoChatForCausalLM", {}, "transformers"),
    "apertus": TinyArch("ApertusConfig", "ApertusForCausalLM", {}, "transformers"),
    "hunyuan_dense": TinyArch("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16}, "transformers"),
}


def make_tiny_model(out_dir: str, arch: str = "qwen3", seed: int = 0, **overrides) -> str:
    """A random tiny model of `arch` in float32, saved as safetensors with a tokenizer."""
    import transformers
    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir)
    cfg_name, model_name, extra, _ = ARCHS[arch]
    kw = dict(vocab_size=len(tok) + 16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
              bos_token_id=None, pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    kw.update(extra)
    kw.update({k: dict(v) if isinstance(v, tuple) else v for k, v in overrides.items()})
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # Random init is small; scale up so greedy continuations are not all the same token.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or "experts" in name:  # (transformers 5 holds experts as [E, ., .])
                p.normal_(0, 0.2 if "embed" not in name else 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def llama_to_internlm2(llama_dir: str, out_dir: str) -> str:
    """InternLM2 (remote code, not in transformers) has no HF class to be the oracle: this writes
    a Llama checkpoint's weights under InternLM2's names and packing, with InternLM2's config.json,
    so that Loom's InternLM2 on out_dir must match HF Llama on llama_dir. The tokenizer files
    are copied."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(llama_dir):
        if f.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(llama_dir, f), out_dir)
    with open(os.path.join(llama_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    sd = load_file(os.path.join(llama_dir, "model.safetensors"))
    out = {}
    for name, t in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:   # [kv_heads, group q heads + k + v, head_dim, ...]
            k, v = sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]
            rest = t.shape[1:]
            t = torch.cat([t.reshape(kv_heads, heads // kv_heads, d, *rest), k.reshape(kv_heads, 1, d, *rest),
                           v.reshape(kv_heads, 1, d, *rest)], 1).reshape(-1, *rest)
        for ours, theirs in (("model.embed_tokens.", "model.tok_embeddings."), (".self_attn.q_proj.", ".attention.wqkv."),
                             (".self_attn.o_proj.", ".attention.wo."), (".mlp.gate_proj.", ".feed_forward.w1."),
                             (".mlp.up_proj.", ".feed_forward.w3."), (".mlp.down_proj.", ".feed_forward.w2."),
                             (".input_layernorm.", ".attention_norm."),
                             (".post_attention_layernorm.", ".ffn_norm."), ("lm_head.", "output.")):
            name = name.replace(ours, theirs)
        out[name] = t.contiguous()
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    # the fields of InternLM2's configuration_internlm2.py (as vLLM's internlm2.py reads them)
    config = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
              "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                           "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
              "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
              "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": cfg["num_hidden_layers"],
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_act": "silu",
              "max_position_embeddings": cfg["max_position_embeddings"], "initializer_range": 0.02,
              "rms_norm_eps": cfg["rms_norm_eps"], "use_cache": True, "pad_token_id": cfg.get("pad_token_id"),
              "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"), "pretraining_tp": 1,
              "tie_word_embeddings": cfg.get("tie_word_embeddings", False), "bias": False,
              "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_scaling": None,
              "attn_implementation": "eager", "torch_dtype": "float32"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
