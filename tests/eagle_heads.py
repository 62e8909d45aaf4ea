"""Tiny random EAGLE heads in the public checkpoint layouts, for a tiny target (tests only):
EAGLE-1 (yuhuili/EAGLE-LLaMA3-Instruct-8B: fc [H, 2H], layers.0.*), EAGLE-3
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: midlayer.* with 2H-wide q/k/v, fc [H, 3H], norm, its own
lm_head over a draft vocabulary, d2t and t2d) and the speculators format of EAGLE-3."""
from __future__ import annotations

import json
import os

import torch


def _layer_config(target: dict) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "rope_parameters", "rope_theta", "head_dim")
    cfg = {k: target[k] for k in keys if k in target}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    return cfg


def head_tensors(target: dict, method: str, seed: int = 0, draft_vocab: int | None = None,
                 scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint's own names (the head's layer as `layers.0.` for
    EAGLE-1, `midlayer.` for EAGLE-3)."""
    g = torch.Generator().manual_seed(seed)
    h, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv = target["num_attention_heads"], target.get("num_key_value_heads") or target["num_attention_heads"]
    d = target.get("head_dim") or h // heads
    attn_in = 2 * h if method == "eagle3" else h
    p = "midlayer." if method == "eagle3" else "layers.0."

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale
    t = {f"{p}self_attn.q_proj.weight": rand(heads * d, attn_in), f"{p}self_attn.k_proj.weight": rand(kv * d, attn_in),
         f"{p}self_attn.v_proj.weight": rand(kv * d, attn_in), f"{p}self_attn.o_proj.weight": rand(h, heads * d),
         f"{p}mlp.gate_proj.weight": rand(inter, h), f"{p}mlp.up_proj.weight": rand(inter, h),
         f"{p}mlp.down_proj.weight": rand(h, inter),
         f"{p}post_attention_layernorm.weight": 1 + rand(h)}
    if method == "eagle3":
        vocab = target["vocab_size"]
        dv = draft_vocab or vocab
        keep = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values   # the draft vocabulary: target ids
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[keep] = True
        t.update({f"{p}input_layernorm.weight": 1 + rand(h), f"{p}hidden_norm.weight": 1 + rand(h),
                  "fc.weight": rand(h, 3 * h), "norm.weight": 1 + rand(h), "lm_head.weight": rand(dv, h) * 5,
                  "d2t": keep - torch.arange(dv), "t2d": t2d})
    else:
        t["fc.weight"] = rand(h, 2 * h)
    return t


def write_head(out_dir: str, target_dir: str, method: str, seed: int = 0, layout: str = "public",
               draft_vocab: int | None = None, tensors: dict | None = None, aux_layers=None) -> str:
    """A head directory for the target in target_dir: `public` (EAGLE's own config.json and
    pytorch_model.bin for EAGLE-1, model.safetensors for EAGLE-3) or `speculators`."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    target = target.get("text_config") or target   # (LLaVA: its language model's)
    tensors = tensors if tensors is not None else head_tensors(target, method, seed, draft_vocab)
    layer = _layer_config(target)
    if layout == "speculators":
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        cfg = {"speculators_model_type": method, "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
               "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]), "norm_before_residual": True,
               "speculators_config": {"algorithm": method, "proposal_methods": [
                   {"proposal_type": "greedy", "speculative_tokens": 3}],
                   "verifier": {"name_or_path": target_dir, "architectures": target.get("architectures")}}}
        if aux_layers is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    else:
        cfg = dict(layer)
        if method == "eagle3":
            cfg["draft_vocab_size"] = int(tensors["lm_head.weight"].shape[0])
            if aux_layers is not None:
                cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if method == "eagle" and layout == "public":
        torch.save(tensors, os.path.join(out_dir, "pytorch_model.bin"))
    else:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir
