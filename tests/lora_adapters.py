"""Random PEFT LoRA adapters for the tiny test models, written by `peft` itself, and the merged
model (W + scale * B @ A, peft's merge_and_unload) as the oracle, in fp32."""
from __future__ import annotations

import functools
import os

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: str, out_dir: str, seed: int, r: int = 4, alpha: int = 8, use_rslora: bool = False,
                 targets: tuple[str, ...] = ALL_TARGETS, std: float = 0.2) -> str:
    """A rank-r adapter of model_dir with random A and B (std `std`), saved by peft into out_dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                     init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=8)
def merged_model(model_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def merged_greedy(model_dir: str, adapter_dir: str | None, prompt: list[int], max_new: int,
                  eos: list[int] | None = None) -> list[int]:
    """HF's greedy tokens with the adapter merged into the weights (None: the base model)."""
    if adapter_dir is None:
        from tests.hf_oracle import hf_greedy
        return hf_greedy(model_dir, prompt, max_new, eos)
    model = merged_model(model_dir, os.path.abspath(adapter_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
