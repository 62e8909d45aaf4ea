"""Real model shapes for benchmarks: the config.json of Qwen3-0.6B, Llama-3.2-1B,
Llama-3.1-8B, Llama-3.1-70B, Qwen3-8B and the mixtures of experts Qwen3-30B-A3B and
Mixtral-8x7B (values as published on the Hugging Face Hub), plus
a stand-in tokenizer, written into a directory that `LLM(..., load_format="dummy")`
and `loom serve DIR --load-format dummy` can load. Speed does not depend on the
weights' values, so no checkpoint is needed.

The tokenizer is byte-level BPE with no merges whose vocabulary covers every id
of the model (256 byte tokens, the model's special tokens at their real ids, and
one word-like token for each other id), so every generated id decodes to text:
a streamed completion then carries one chunk per token, as with the real model.
"""
from __future__ import annotations

import json
import os

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_LLAMA3_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


def _llama3_rope(factor: float) -> dict:
    return {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "max_window_layers": 28, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "max_window_layers": 36, "tie_word_embeddings": False},
    # Qwen3-8B-FP8's quantization_config: block-wise FP8 (--load-format dummy draws weights in its layout)
    "qwen3-8b-fp8": {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                     "num_attention_heads": 32, "max_window_layers": 36, "tie_word_embeddings": False,
                     "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}},
    "llama-3.2-1b": {**_LLAMA3_COMMON, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "rope_scaling": _llama3_rope(32.0), "tie_word_embeddings": True,
                     "transformers_version": "4.45.0.dev0"},
    "llama-3.1-8b": {**_LLAMA3_COMMON, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "rope_scaling": _llama3_rope(8.0), "tie_word_embeddings": False,
                     "transformers_version": "4.43.0.dev0"},
    "llama-3.1-70b": {**_LLAMA3_COMMON, "head_dim": 128, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64, "rope_scaling": _llama3_rope(8.0),
                      "tie_word_embeddings": False, "transformers_version": "4.43.0.dev0"},
    # Mistral-7B-v0.3 (v0.2 on: no sliding window)
    "mistral-7b": {**_LLAMA3_COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                   "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "max_position_embeddings": 32768,
                   "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
                   "vocab_size": 32768, "transformers_version": "4.42.0.dev0"},
    # Gemma-2-9B: sandwich norms, GeGLU, soft-capped attention and logits, local (4,096) and global
    # layers alternating, head_dim 256, a 256k vocabulary tied to the embedding
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
        "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000,
    },
    # Qwen3-30B-A3B: 48 layers, each a mixture of 128 experts (moe_intermediate_size 768), top-8
    # with renormalised weights; 30.5 B parameters, 3.3 B active per token
    "qwen3-30b-a3b": {**_QWEN3_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "max_window_layers": 48,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
                      "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
                      "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False},
    # Mixtral-8x7B-v0.1: 32 layers of 8 experts (intermediate 14336), top-2; 46.7 B parameters
    "mixtral-8x7b": {**_LLAMA3_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "max_position_embeddings": 32768,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "output_router_logits": False,
                     "router_aux_loss_coef": 0.02, "rope_theta": 1000000.0, "sliding_window": None,
                     "tie_word_embeddings": False, "vocab_size": 32000, "transformers_version": "4.36.0.dev0"},
    # Qwen2.5-VL-7B-Instruct (the Hub's config.json layout; transformers 5 reads it into
    # text_config / vision_config): a 32-block ViT (windowed but for 4 full-attention blocks)
    # in front of a Qwen2-7B-shaped language model with M-RoPE.
    "qwen2.5-vl-7b": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 128000, "max_window_layers": 28,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 152064, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                          "temporal_patch_size": 2},
    },
    # gpt-oss-20b (the Hub's config.json, its experts bf16 rather than MXFP4 for --load-format
    # dummy): 24 layers, sliding-window (128) and full alternating, attention sinks, 64 query and 8
    # KV heads of 64, 32 experts top-4 with biases and the clamped SwiGLU, YaRN to 131,072
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "bos_token_id": 199998, "eos_token_id": 200002, "pad_token_id": 199999,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.55.0", "use_cache": True, "vocab_size": 201088,
    },
}

# speech recognition presets, written with their feature extractor and special tokens by bench/whisper_asr.py
ASR_PRESETS = ("whisper-large-v3",)

# what the Qwen2-VL image processor needs (Qwen2.5-VL-7B-Instruct's preprocessor_config.json)
_QWEN_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}

_QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# special tokens at their real ids; the first listed eos is the model's eos_token
_SPECIAL = {
    "qwen3": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
    "qwen3_moe": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
    "llama": {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>"},
    "mistral": {2: "</s>", 1: "<s>"},
    "mixtral": {2: "</s>", 1: "<s>"},
    "gemma2": {1: "<eos>", 2: "<bos>", 0: "<pad>", 106: "<start_of_turn>", 107: "<end_of_turn>"},
    "qwen2_5_vl": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
                   151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
                   151655: "<|image_pad|>", 151656: "<|video_pad|>"},
    # the harmony format's tokens (o200k_harmony)
    "gpt_oss": {200002: "<|return|>", 199998: "<|startoftext|>", 199999: "<|endoftext|>", 200003: "<|constrain|>",
                200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                200012: "<|call|>"},
}


def num_params(cfg: dict) -> int:
    """Parameter count of a decoder-only preset (for messages and memory estimates)."""
    h, i, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    mlp = 3 * h * i
    if experts:  # every layer a mixture (the presets have no dense layers): the experts and the router
        mlp = experts * 3 * h * (cfg.get("moe_intermediate_size") or i) + h * experts
    per_layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        per_layer += 2 * d  # q_norm, k_norm
    if cfg["model_type"] == "gemma2":
        per_layer += 2 * h  # the pre-feedforward and post-feedforward norms
    vision = 0
    if "vision_config" in cfg:  # ViT blocks + patch embedding + merger, roughly
        vc = cfg["vision_config"]
        vh, vi = vc["hidden_size"], vc["intermediate_size"]
        vision = vc["depth"] * (4 * vh * vh + 3 * vh * vi) + 3 * 2 * 14 * 14 * vh + 4 * vh * (4 * vh + h)
    return n * per_layer + v * h * (1 if cfg["tie_word_embeddings"] else 2) + h + vision


def write_tokenizer(out_dir: str, vocab_size: int, special: dict[int, str], eos_id: int, bos_id: int | None):
    """A byte-level BPE tokenizer (no merges) whose vocabulary is exactly vocab_size ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for i in range(vocab_size):
        if i in special:
            tok = special[i]
        elif i < len(alphabet):
            tok = alphabet[i]
        else:
            tok = f"\u0120t{i}"      # "Ġt123" decodes to " t123"
        vocab[tok] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special.values()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special[eos_id],
                                   bos_token=special.get(bos_id) if bos_id is not None else None,
                                   pad_token=special[eos_id], unk_token=None)
    fast.save_pretrained(out_dir)
    return fast


def write_preset(name: str, out_dir: str) -> str:
    """Write config.json, generation_config.json and the tokenizer of preset `name` into out_dir."""
    if name in ASR_PRESETS:
        from bench.whisper_asr import write_whisper_preset
        return write_whisper_preset(out_dir)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (one of {', '.join(PRESETS)})")
    cfg = PRESETS[name]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f, indent=2)
    tok = write_tokenizer(out_dir, cfg["vocab_size"], _SPECIAL[cfg["model_type"]], cfg["eos_token_id"],
                          cfg["bos_token_id"] if cfg["model_type"] in ("llama", "mistral", "mixtral", "gemma2") else None)
    if "vision_config" in cfg:  # the image processor and a chat template that places images
        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(_QWEN_VL_PREPROCESSOR, f, indent=2)
        tok.chat_template = _QWEN_VL_TEMPLATE
        tok.save_pretrained(out_dir)
    return out_dir
