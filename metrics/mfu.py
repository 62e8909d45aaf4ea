"""Estimated FLOPs and memory traffic of each engine step (`--enable-mfu-metrics`).

The estimate is for a dense decoder-only transformer with grouped-query
attention and a gated (SwiGLU) MLP: the Llama / Qwen / Mistral family. Shapes
come from the model's config.json (its `text_config` when nested):

    L  num_hidden_layers        H  hidden_size          I  intermediate_size
    q  num_attention_heads      k  num_key_value_heads  d  head_dim (default H / q)
    V  vocab_size               b  bytes per element of the model dtype (weights and KV cache)
    tp tensor_parallel_size

Per engine step, from SchedulerStats:

    T  num_scheduled_tokens      tokens run through the model
    P  num_attn_query_key_pairs  sum over those tokens of the keys each attends to (causal)
    K  num_kv_tokens_read        sum over scheduled requests of their context length after the step
    S  num_generation_tokens     tokens sampled (one LM-head row each)

FLOPs (a multiply-add counts 2):

    per layer  2·T·H·(q+2k)·d        Q, K, V projections
             + 2·T·q·d·H             output projection
             + 3·2·T·H·I             gate, up and down projections
             + 2·2·P·q·d             Q·Kᵀ and attention·V
    step       L·(per layer) + 2·S·H·V      (LM head)

Bytes read:

    weights, once per step that ran tokens (T > 0):
               b·(L·(H·(q+2k)·d + q·d·H + 3·H·I) + V·H)
    KV cache   b·L·2·k·d·K
    embedding rows  b·T·H

Bytes written: the new KV entries, b·L·2·k·d·T.

Mixture of experts (Qwen3-MoE / Qwen2-MoE `num_experts`, Mixtral / gpt-oss `num_local_experts`):
a MoE layer's MLP counts the experts a token runs, not all of them,

    E experts, k num_experts_per_tok, Ie moe_intermediate_size (Mixtral, gpt-oss: intermediate_size),
    Is shared_expert_intermediate_size (Qwen2-MoE; 0 elsewhere)
    FLOPs       2·T·(k·3·H·Ie + H·E + 3·H·Is)      the chosen experts, the router, the shared expert
    weights     b·(E_read·3·H·Ie + H·E + 3·H·Is),  E_read = E·(1 - (1 - k/E)^T)

E_read is the expected number of distinct experts T tokens choose when each picks k of E
uniformly: the expert weights a step must read (T = 1 reads k experts, a large batch all E).
The MoE layers are those not in `mlp_only_layers` whose index + 1 is a multiple of
`decoder_sparse_step` (Qwen's rules; every layer for Mixtral and gpt-oss); the others are dense.

Each total is divided by tp (per GPU). Not counted: norms, rotary embedding,
softmax, sampling, activations passed between kernels, biases; sliding-window is not
modelled. Quantized decoder linears (not the experts) count their stored bytes per weight
(FP8 1, 4-bit 0.5; their scales left out) in place of b.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    tp: int = 1
    # mixture of experts (num_experts 0: a dense model)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = 0
    kv_dtype_bytes: int | None = None   # the KV cache's element (1: --kv-cache-dtype fp8); None: dtype_bytes
    linear_weight_bytes: float = 0.0   # bytes per weight of the quantized decoder linears (0: dtype_bytes)

    @classmethod
    def from_hf_config(cls, hf: dict, dtype_bytes: int, tp: int = 1) -> "ModelShape":
        c = hf.get("text_config", hf)
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        layers = int(c["num_hidden_layers"])
        experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        moe = {}
        if experts:
            step, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or ())
            moe = dict(num_experts=experts, top_k=int(c["num_experts_per_tok"]),
                       moe_intermediate_size=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
                       shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
                       num_moe_layers=sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0))
        return cls(num_layers=layers, hidden_size=hidden, num_heads=heads,
                   num_kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or hidden // heads),
                   intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
                   dtype_bytes=dtype_bytes, tp=tp, **moe)

    @classmethod
    def from_engine_config(cls, config) -> "ModelShape":
        with open(os.path.join(config.model, "config.json")) as f:
            hf = json.load(f)
        shape = cls.from_hf_config(hf, dtype_bytes(config), getattr(config, "tensor_parallel_size", 1))
        if getattr(config, "kv_cache_dtype", "auto") != "auto":   # fp8 / fp8_e4m3
            shape = dataclasses.replace(shape, kv_dtype_bytes=1)
        return dataclasses.replace(shape, linear_weight_bytes=quantized_weight_bytes(config, hf))


def quantized_weight_bytes(config, hf: dict) -> float:
    """Bytes per weight of the decoder linears under --quantization / quantization_config (0:
    unquantized): FP8 1, 4-bit formats 0.5, compressed-tensors by its weights' num_bits."""
    from ipc.config import weight_quantization
    method = weight_quantization(config)
    if method is None:
        return 0.0
    if method == "compressed-tensors":
        qc = hf.get("quantization_config") or hf.get("text_config", {}).get("quantization_config") or {}
        bits = [(g.get("weights") or {}).get("num_bits") for g in (qc.get("config_groups") or {}).values()]
        return (bits[0] or 16) / 8 if bits else 0.0
    return {"fp8": 1.0, "gptq": 0.5, "awq": 0.5}.get(method, 0.0)


def dtype_bytes(config) -> int:
    """Bytes per element of the dtype the workers run in: "auto" is bf16 on a GPU, fp32 on CPU
    (as workers/model_runner.resolve_dtype decides)."""
    if config.dtype != "auto":
        return _DTYPE_BYTES[config.dtype]
    device = config.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return 2 if device.startswith("cuda") else 4


@dataclass
class StepCost:
    flops: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0


def expected_experts_read(num_experts: int, top_k: int, num_tokens: int) -> float:
    """E·(1 - (1 - k/E)^T): distinct experts that T tokens choosing k of E uniformly touch."""
    if num_experts <= 0 or num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


class MfuEstimator:
    def __init__(self, shape: ModelShape):
        self.s = s = shape
        h = s.hidden_size
        qkv = h * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        out = s.num_heads * s.head_dim * h
        dense_layers = s.num_layers - s.num_moe_layers
        # every layer's attention, the dense layers' MLPs, a MoE layer's shared expert (the linears
        # that --quantization quantizes) and its router
        linears = (s.num_layers * (qkv + out) + dense_layers * 3 * h * s.intermediate_size
                   + s.num_moe_layers * 3 * h * s.shared_expert_intermediate_size)
        router = s.num_moe_layers * h * s.num_experts
        self._expert_params = 3 * h * s.moe_intermediate_size    # one expert of one layer
        self._params_per_token = linears + router + s.num_moe_layers * s.top_k * self._expert_params
        stored = s.linear_weight_bytes / s.dtype_bytes if s.linear_weight_bytes else 1.0   # quantized: fewer bytes
        self._always_read = linears * stored + router + s.vocab_size * h
        self._kv_elems_per_token = s.num_layers * 2 * s.num_kv_heads * s.head_dim

    def weight_params_read(self, num_tokens: int) -> float:
        """Weight elements a step of num_tokens tokens reads: all of a dense model's, a MoE
        model's shared ones and the expected distinct experts of each MoE layer."""
        if num_tokens <= 0:
            return 0.0
        s = self.s
        experts = expected_experts_read(s.num_experts, s.top_k, num_tokens)
        return self._always_read + s.num_moe_layers * experts * self._expert_params

    def step(self, num_tokens: int, num_qk_pairs: int, num_kv_tokens_read: int,
             num_sampled: int) -> StepCost:
        s = self.s
        if num_tokens <= 0 and num_sampled <= 0:
            return StepCost()
        flops = (2 * num_tokens * self._params_per_token
                 + s.num_layers * 4 * num_qk_pairs * s.num_heads * s.head_dim
                 + 2 * num_sampled * s.hidden_size * s.vocab_size)
        kv_bytes = s.kv_dtype_bytes or s.dtype_bytes
        read = (s.dtype_bytes * (self.weight_params_read(num_tokens) + num_tokens * s.hidden_size)
                + kv_bytes * self._kv_elems_per_token * num_kv_tokens_read)
        write = kv_bytes * self._kv_elems_per_token * num_tokens
        return StepCost(flops / s.tp, read / s.tp, write / s.tp)

    def from_stats(self, stats) -> StepCost:
        return self.step(stats.num_scheduled_tokens, stats.num_attn_query_key_pairs, stats.num_kv_tokens_read,
                         stats.num_generation_tokens)
