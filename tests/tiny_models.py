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
    "qwen2": TinyArch("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": TinyArch("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": TinyArch("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": None}),
    "olmo2": TinyArch("Olmo2Config", "Olmo2ForCausalLM", {}),
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
    "cwm": TinyArch("CwmConfig", "CwmForCausalLM", {"sliding_window": 256, "bos_token_id": 0,
                                                    "layer_types": ["full_attention", "sliding_attention"]},
                    "transformers"),
    "exaone4": TinyArch("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": 256, "sliding_window_pattern": 4},
                        "transformers"),
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
            if p.dim() == 2:
                p.normal_(0, 0.2 if "embed" not in name else 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
