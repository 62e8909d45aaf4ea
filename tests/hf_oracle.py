"""Hugging Face transformers as the correctness oracle."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, eos: list[int] | None = None,
              **generate_kwargs) -> list[int]:
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             **generate_kwargs)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position: [len, vocab]."""
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
