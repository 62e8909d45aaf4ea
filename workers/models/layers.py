"""The primitives every model is built from: the hot ops, RMSNorm, the rotary embedding, and
the tensor-parallel linears and vocabulary embedding (each parameter with its weight loader).
Models compose them into decoder layers in workers/models/blocks.py, or in their own file
where their layer differs (workers/models/olmo2.py); docs/adding_a_model.md says how.

Every hot op goes through one module-level name (`rms_norm`,
`fused_add_rms_norm`, `qk_norm_rope_cache`, `silu_and_mul`, `gelu_tanh_and_mul`): the plain-torch
reference from kernels/ by default, rebound to the Triton kernel by
use_triton_kernels(). The layers look the name up at run time, so nothing else
changes. On the Triton path, linears of decode-sized batches (up to
kernels.gemv.MAX_DECODE_ROWS rows) run kernels/gemv.py, which also takes over
the norm before the qkv and gate/up projections and the SiLU before the down
projection, and runs tensor-core kernels or cuBLAS above 8 rows, whichever its
tuned tiles say is faster (LOOM_GEMV=0 turns it off, for A/B runs).

Parameters are created with `torch.empty` (no init): the model is built under
`torch.device(...)` and a default dtype by `workers.model_loader`, and then every
parameter is filled by the weight loader (or with dummy values).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ipc import envs
from kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from kernels.embedding import vocab_parallel_embedding
from kernels.fused_moe import fused_moe_ref, select_experts
from kernels.qk_rope_cache import qk_norm_rope_cache_ref
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import build_rope_cache

from workers.distributed import (LogitsShard, PendingSum, all_reduce, all_reduce_written, linear_all_reduce,
                                 lm_head_logits, tp_rank, tp_size)

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- ops
# The torch references in kernels/ (HF's numerics); use_triton_kernels() rebinds them.
rms_norm = rms_norm_ref
fused_add_rms_norm = fused_add_rms_norm_ref
qk_norm_rope_cache = qk_norm_rope_cache_ref  # per-head q/k norm, rotary, then the KV-cache write
silu_and_mul = silu_and_mul_ref
gelu_tanh_and_mul = gelu_tanh_and_mul_ref  # GeGLU (Gemma); no GEMV fusion
gemv = None           # kernels.gemv.gemv on the Triton path (use_triton_kernels)
gemv_max_rows = 0
fused_moe = fused_moe_ref            # the routed experts (workers/models/moe.py)
select_experts = select_experts      # their router's top-k (kernels.fused_moe.fused_topk on Triton)
# where the linears create their dense weight: "meta" while a quantized model is built (the
# quantization method then makes its own parameters, so the dense ones never take memory)
linear_weight_device: str | None = None


# ------------------------------------------------------------------ config helpers
_TORCH_REFERENCES = dict(rms_norm=rms_norm, fused_add_rms_norm=fused_add_rms_norm,
                         qk_norm_rope_cache=qk_norm_rope_cache, silu_and_mul=silu_and_mul,
                         gelu_tanh_and_mul=gelu_tanh_and_mul, gemv=None,
                         gemv_max_rows=0, fused_moe=fused_moe_ref, select_experts=select_experts)


def use_kernels(backend: str) -> None:
    """Route the ops above through the Triton kernels ("triton") or the torch references. The
    choice is the process's: each model runner makes it when it starts, so an in-process engine
    (engine_core/uniproc_executor.py) never inherits an earlier engine's."""
    if backend == "triton":
        use_triton_kernels()
    else:
        globals().update(_TORCH_REFERENCES)


def use_triton_kernels() -> None:
    """The GPU path: route the ops above through the Triton kernels in kernels/."""
    from kernels import activation, qk_rope_cache
    from kernels import fused_moe as triton_moe
    from kernels import rms_norm as triton_norm

    globals().update(rms_norm=triton_norm.rms_norm, fused_add_rms_norm=triton_norm.fused_add_rms_norm,
                     silu_and_mul=activation.silu_and_mul, gelu_tanh_and_mul=activation.gelu_tanh_and_mul,
                     qk_norm_rope_cache=qk_rope_cache.qk_norm_rope_cache, fused_moe=triton_moe.fused_moe,
                     select_experts=triton_moe.fused_topk)
    if envs.LOOM_GEMV:
        from kernels import gemv as gemv_kernel
        globals().update(gemv=gemv_kernel.gemv, gemv_max_rows=gemv_kernel.MAX_DECODE_ROWS)


def use_gemv(x: torch.Tensor) -> bool:
    """Whether a linear of x [T, K] runs the decode GEMV (with its fused prologue)."""
    return gemv is not None and x.dim() == 2 and 0 < x.shape[0] <= gemv_max_rows


def get_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, size: int) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of `rank`. Query heads split evenly; KV heads
    split evenly when there are at least as many as ranks, else each KV head is replicated on
    the size / num_kv_heads ranks whose query heads use it (ConfigError checks divisibility)."""
    if num_kv_heads >= size:
        return num_heads // size, num_kv_heads // size, rank * (num_kv_heads // size)
    return num_heads // size, 1, rank * num_kv_heads // size


def get_rope_params(config, layer_type: str = "full_attention") -> dict:
    """The rope parameters of a layer type ("full_attention", or "sliding_attention" where local
    layers rotate otherwise: Gemma 3) as one flat dict with at least `rope_theta` and
    `rope_type`, from either layout:

    * transformers 5: `config.rope_parameters = {"rope_theta": ..., "rope_type": ..., ...}`
      (possibly keyed per layer type);
    * older configs: `config.rope_theta` plus `config.rope_scaling` (None, or a
      dict with "rope_type" or the older "type"); Gemma 3's local layers: `rope_local_base_freq`
      and no scaling."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        return {"rope_theta": float(config.rope_local_base_freq), "rope_type": "default"}
    out: dict = {}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        out.update(scaling)
    if isinstance(params, dict):
        out.update(params)
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    rope_type = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = rope_type
    if getattr(config, "partial_rotary_factor", None) is not None and "partial_rotary_factor" not in out:
        out["partial_rotary_factor"] = config.partial_rotary_factor
    # HF's reference lengths: the config's own (dynamic NTK; the factor when a config leaves it
    # out) and the pretraining one, which Phi-3 keeps beside rope_scaling and HF prefers
    if getattr(config, "max_position_embeddings", None):
        out["max_position_embeddings"] = config.max_position_embeddings
    if rope_type in ("llama3", "yarn", "longrope"):
        original = getattr(config, "original_max_position_embeddings", None) or out.get(
            "original_max_position_embeddings") or out.get("max_position_embeddings")
        if original:
            out["original_max_position_embeddings"] = original
    return out


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window layer `layer_idx` attends within, or None (full attention): from
    `layer_types` where the config lists them (Gemma 2/3, newer Qwen2 and Mistral configs),
    else Qwen2's `use_sliding_window` from layer `max_window_layers` on, else every layer
    (Mistral's `sliding_window`)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if hasattr(config, "use_sliding_window"):
        if not config.use_sliding_window or layer_idx < getattr(config, "max_window_layers", 0):
            return None
    return int(window)


# ------------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = replicated(nn.Parameter(torch.empty(hidden_size), requires_grad=False))
        self.eps = eps

    def forward(self, x: torch.Tensor | PendingSum, residual: torch.Tensor | None = None):
        """Without residual: the normalized x. With residual: x + residual is
        normalized and (out, new_residual) returned. x may be a row-parallel linear's
        PendingSum: the sum over the ranks is then fused in."""
        if isinstance(x, PendingSum):
            return x.add_rms_norm(residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x_normed * (1 + w) (HF's GemmaRMSNorm). The weight loader stores 1 + w
    (added in float32, rounded once), so that the norm kernels, the GEMV's fused norm prologue
    and the all-reduce norm serve it unchanged, with no Gemma variant of each. Hence every write
    of w must go through the loader: the checkpoint and weight updates (partial loads,
    workers/weight_update.py) do; dummy weights (init_dummy_weights) set every norm's stored
    weight to 1, which here is HF's initial w = 0 (a scale of 1, as for any RMSNorm); reading
    back by name subtracts `stored_offset`. In bf16 this differs from HF, which scales in float32
    and rounds once, by the rounding of 1 + w and of the normed x to bf16 (as Llama's norm does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        _set_loader(self.weight, one_plus_loader, self.weight.shape)
        self.weight.stored_offset = 1.0   # stored = checkpoint + 1 (get_weights_by_name reads back w)


class LayerNorm(nn.Module):
    """LayerNorm in float32 (mean-subtracted; `bias` optional: Cohere has none, StableLM has one),
    rounded to the input's dtype once, with RMSNorm's calling convention (with `residual`:
    x + residual is normed and (out, new_residual) returned)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.weight = replicated(nn.Parameter(torch.empty(hidden_size), requires_grad=False))
        self.bias = replicated(nn.Parameter(torch.empty(hidden_size), requires_grad=False)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return layer_norm(x, self.weight, self.bias, self.eps)
        x = x + residual
        return layer_norm(x, self.weight, self.bias, self.eps), x


class PerHeadLayerNorm(nn.Module):
    """LayerNorm over each head of x [T, heads * head_dim], in float32, with one weight row per
    head (no bias): Cohere's and StableLM's q/k norms. Under tensor parallelism a rank holds its
    heads' rows, from `first_head` on. The checkpoint holds the rows as one [total_heads,
    head_dim] tensor (Cohere), or one tensor per head (StableLM's `norms.{h}`: `per_head_tensors`,
    loaded with the head as shard id)."""

    def __init__(self, total_heads: int, first_head: int, heads: int, head_dim: int, eps: float,
                 per_head_tensors: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, head_dim), requires_grad=False)
        _set_loader(self.weight, functools.partial(_per_head_loader, total_heads, first_head),
                    (total_heads, head_dim), tuple(range(total_heads)) if per_head_tensors else (None,))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], *self.weight.shape).float()
        return (F.layer_norm(h, h.shape[-1:], eps=self.eps) * self.weight.float()).to(x.dtype).view(x.shape)


@torch.no_grad()
def _per_head_loader(total_heads: int, first_head: int, param: nn.Parameter, loaded, shard_id=None) -> None:
    heads, head_dim = param.shape
    if shard_id is None:   # all heads' rows (dummy weights draw them so too)
        _check_shape(loaded, (total_heads, head_dim))
        param.data.copy_(_narrow(loaded, 0, first_head, heads))
        return
    _check_shape(loaded, (head_dim,))
    if first_head <= shard_id < first_head + heads:   # another rank's head: not kept here
        param.data[shard_id - first_head].copy_(_narrow(loaded, 0, 0, head_dim))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dim of x (weight and bias of that size) in float32."""
    return F.layer_norm(x.float(), weight.shape, weight.float(), None if bias is None else bias.float(),
                        eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Positions-based rotary embedding over a precomputed float32 cos/sin cache
    of `max_position` rows. One instance is shared by all layers of a model.

    rope_type: any of kernels.rotary.ROPE_TYPES (default, linear, dynamic, yarn, longrope,
    llama3), as transformers computes them; an unknown type is a ValueError naming those, at
    start-up. `partial_rotary_factor` rotates the first head_size * factor dims only.
    max_position: the longest context served; the models pass the config's
    max_position_embeddings, which the engine's --max-model-len never exceeds. It also picks
    what HF picks per sequence length (vLLM's rule): LongRoPE's long factors when it exceeds
    original_max_position_embeddings (Phi-3's long-context configs: HF's choice for every
    prompt past the original context), and the dynamic-NTK base of a max_position-token
    sequence when it exceeds the config's max_position_embeddings (else HF's own frequencies
    at every length within it)."""

    def __init__(self, head_size: int, max_position: int, rope_params: dict, is_neox_style: bool = True):
        super().__init__()
        self.head_size = head_size
        self.is_neox_style = is_neox_style  # False: GPT-J style, interleaved pairs (GLM, Cohere)
        factor = rope_params.get("partial_rotary_factor", 1.0) or 1.0
        self.rotary_dim = int(head_size * factor)
        self.rope_params = dict(rope_params)
        self.rope_type = rope_params["rope_type"]
        # M-RoPE (Qwen2-VL family): the rot/2 frequencies split into (temporal, height, width)
        # sections, each turned by its own row of [3, T] positions
        section = rope_params.get("mrope_section")
        self.mrope_section = tuple(section) if section else None
        # Built on the CPU (as HF computes inv_freq at init), then moved with the model.
        cache = build_rope_cache(self.rotary_dim, max_position, float(rope_params["rope_theta"]), rope_params)
        self.register_buffer("cos_sin_cache", cache, persistent=False)



class NoRotary(nn.Module):
    """A rotary embedding that does not rotate (NoPE layers: SmolLM3, EXAONE 4.0, Cohere2's global
    layers): cos 1 and sin 0 at every position, so the fused rotary + KV-cache op
    (qk_norm_rope_cache) passes q and k through unchanged (x * 1 + y * 0 is x exactly)."""
    mrope_section = None
    is_neox_style = True

    def __init__(self, head_size: int, max_position: int):
        super().__init__()
        half = (max_position, head_size // 2)
        cache = torch.cat([torch.ones(half, dtype=torch.float32), torch.zeros(half, dtype=torch.float32)], -1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)


# ------------------------------------------------------------ tensor-parallel layers
# Each parameter owns its weight loader (vLLM's convention): `param.weight_loader(param, loaded,
# shard_id=None)` copies this rank's part of a checkpoint tensor into it. `loaded` is a tensor or
# a safetensors slice (safe_open(...).get_slice(name)), from which only this rank's rows or
# columns are read: per-rank host and device memory stay ~1/N of the weights.
# `param.full_shape` is the parameter's shape at TP=1 (dummy weights are drawn at that shape and
# sharded, so a TP=N dummy model is the TP=1 dummy model split), and `param.shard_ids` the
# checkpoint tensors a fused parameter is stacked from.

def _shape(loaded) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def _narrow(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[start:start+size] along dim; from a safetensors slice only those bytes are read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def _check_shape(loaded, expected: tuple[int, ...]) -> None:
    if _shape(loaded) != tuple(expected):
        raise ValueError(f"checkpoint shape {_shape(loaded)} != expected {tuple(expected)}")


def _set_loader(param: nn.Parameter, loader, full_shape: tuple[int, ...], shard_ids=(None,)) -> None:
    param.weight_loader, param.full_shape, param.shard_ids = loader, tuple(full_shape), tuple(shard_ids)


@torch.no_grad()
def replicated_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Every rank holds the whole tensor (norms, row-parallel biases)."""
    _check_shape(loaded, param.shape)
    param.data.copy_(_narrow(loaded, 0, 0, param.shape[0]))


@torch.no_grad()
def one_plus_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Replicated, storing 1 + w (GemmaRMSNorm)."""
    _check_shape(loaded, param.shape)
    param.data.copy_(_narrow(loaded, 0, 0, param.shape[0]).float() + 1)


def replicated(param: nn.Parameter) -> nn.Parameter:
    _set_loader(param, replicated_loader, param.shape)
    return param


@dataclass(frozen=True)
class Shard:
    """This rank's part of one checkpoint tensor of a column-parallel layer: rows
    [start, start + size) of the tensor's `full` rows, held at `offset` of the parameter."""
    full: int
    start: int
    size: int
    offset: int


def split_shards(full_sizes: dict, rank: int, size: int) -> dict:
    """Each checkpoint tensor (by shard id) split evenly over the ranks, stacked in order."""
    out, offset = {}, 0
    for sid, full in full_sizes.items():
        part = full // size
        out[sid] = Shard(full, rank * part, part, offset)
        offset += part
    return out


@torch.no_grad()
def _column_loader(shards: dict, param: nn.Parameter, loaded, shard_id=None) -> None:
    if shard_id is None and list(shards) != [None]:
        # a fused tensor as a whole (dummy weights): split by the checkpoint tensors' sizes
        offset = 0
        for sid, s in shards.items():
            _column_loader(shards, param, _narrow(loaded, 0, offset, s.full), sid)
            offset += s.full
        return
    s = shards[shard_id]
    _check_shape(loaded, (s.full,) + tuple(param.shape[1:]))
    param.data.narrow(0, s.offset, s.size).copy_(_narrow(loaded, 0, s.start, s.size))


def aligned(n: int, to: int = 64) -> int:
    """n rounded up to a multiple of `to`."""
    return -(-n // to) * to


@torch.no_grad()
def padded_columns_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """A checkpoint's [out, in] into the parameter's first `in` columns (its full_shape); the
    padding columns after them stay as they are (zero)."""
    _check_shape(loaded, param.full_shape)
    param.data.narrow(1, 0, param.full_shape[1]).copy_(_narrow(loaded, 0, 0, param.full_shape[0]))


class ReplicatedGatedMLP(nn.Module):
    """An encoder's down(silu(gate(x)) * up(x)), whole on every rank (plain linears with biases),
    in two matmuls: gate and up stacked in one weight (loaded through the language model's
    gate_up_proj mapping: gate_proj, up_proj), the SiLU and product in one kernel. The hidden
    width is padded with zero rows (gate, up) and zero columns (down) to a multiple of 64, which
    leaves the output as it is: cuBLAS runs its fast kernels only on 16-byte aligned rows."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        wide = aligned(hidden)
        self.gate_up_proj = nn.Linear(dim, 2 * wide)
        self.gate_up_proj.shards = {0: Shard(hidden, 0, hidden, 0), 1: Shard(hidden, 0, hidden, wide)}
        self.down_proj = nn.Linear(wide, dim)
        for p in (self.gate_up_proj.weight, self.gate_up_proj.bias, self.down_proj.weight):
            p.requires_grad_(False).zero_()   # (the padding: never written by a loader)
        loader = functools.partial(_column_loader, self.gate_up_proj.shards)
        _set_loader(self.gate_up_proj.weight, loader, (2 * hidden, dim), self.gate_up_proj.shards)
        _set_loader(self.gate_up_proj.bias, loader, (2 * hidden,), self.gate_up_proj.shards)
        _set_loader(self.down_proj.weight, padded_columns_loader, (dim, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over the ranks: each rank computes its slice
    of y, no communication. A fused layer (qkv_proj = [q; k; v], gate_up_proj = [gate; up])
    stacks several checkpoint tensors along the output dim, each split over the ranks, so
    every rank's slice stays one fused matmul. `shards`: shard id -> Shard (None: unfused).
    `quant_method`: a workers/quantization LinearMethod that owns the weights and the matmul
    (installed by the model loader; None: the dense weight and the paths below)."""
    quant_method = None

    def __init__(self, in_features: int, shards: dict, bias: bool = False):
        super().__init__()
        self.shards = shards
        self.in_features = in_features
        self.out_features = sum(s.size for s in shards.values())  # this rank's
        full_out = sum(s.full for s in shards.values())
        loader = functools.partial(_column_loader, shards)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, device=linear_weight_device),
                                   requires_grad=False)
        _set_loader(self.weight, loader, (full_out, in_features), shards)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
            _set_loader(self.bias, loader, (full_out,), shards)
        else:
            self.register_parameter("bias", None)

    lora = None   # workers/lora/layers.LoRALinear with --enable-lora: adds each row's adapter delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, self.bias)
        elif use_gemv(x):
            if _lora_active(self):   # the adapters' delta in the GEMV's epilogue (after the shrink)
                return gemv(x, self.weight, self.bias, lora=self.lora.epilogue(x))[0]
            y = gemv(x, self.weight, self.bias)[0]
        else:
            y = F.linear(x, self.weight, self.bias)
        return self.lora.add(x, y) if _lora_active(self) else y

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and the new residual x + residual (residual None: the first
        layer, where x itself is the residual). At decode sizes the norm is fused into the GEMV;
        after a row-parallel linear's PendingSum, into the all-reduce."""
        if isinstance(x, PendingSum):
            normed, residual = norm(x, residual)
            return self(normed), residual
        # (a quantized linear runs the norm on its own unless its weight suits the GEMV: FP8 per
        # channel; LoRA's delta needs the normed x itself)
        gw = _gemv_weight(self, x) if use_gemv(x) and not _lora_active(self) else None
        if gw is not None:
            if residual is None:
                return gemv(x, gw[0], self.bias, prologue="rms_norm", norm_weight=norm.weight,
                            eps=norm.eps, scale=gw[1])[0], x
            return gemv(x, gw[0], self.bias, prologue="add_rms_norm", residual=residual,
                        norm_weight=norm.weight, eps=norm.eps, scale=gw[1])
        if _lora_active(self) and self.lora.fused_shrink(self, x):   # batch 1: the norm and the shrink fused
            return self.lora.normed_forward(self, x, residual, norm)
        if residual is None:
            return self(norm(x)), x
        normed, residual = norm(x, residual)
        return self(normed), residual


def _gemv_weight(linear: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, per-channel scale or None) the decode GEMV multiplies x by; None: the layer's
    quantization method runs the matmul itself."""
    if linear.quant_method is None:
        return linear.weight, None
    return linear.quant_method.gemv_weight(linear, x)


def _lora_active(linear: nn.Module) -> bool:
    """Whether this step adds LoRA deltas to the linear (it has adapters, and the step adapter rows)."""
    return linear.lora is not None and linear.lora.active


@torch.no_grad()
def _row_loader(rank: int, size: int, param: nn.Parameter, loaded, shard_id=None) -> None:
    part = param.shape[1]
    _check_shape(loaded, (param.shape[0], part * size))
    param.data.copy_(_narrow(loaded, 1, rank * part, part))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ b): W's input columns split over the ranks (x is
    already split: the heads / the intermediate features of this rank), then one all-reduce.
    The bias is added once, after the sum.

    norm_slot (0 or 1): an RMSNorm consumes this linear's output, so without a bias the sum
    may be deferred to it (a PendingSum, see workers/distributed.py). Deferred sums must
    alternate slots: o_proj takes 0 and down_proj 1. `quant_method`: as ColumnParallelLinear's."""
    quant_method = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, norm_slot: int | None = None):
        super().__init__()
        self.tp = tp_size()
        self.norm_slot = norm_slot if not bias else None
        self.in_features, self.out_features = in_features // self.tp, out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features, device=linear_weight_device),
                                   requires_grad=False)
        _set_loader(self.weight, functools.partial(_row_loader, tp_rank(), self.tp), (out_features, in_features))
        if bias:
            self.bias = replicated(nn.Parameter(torch.empty(out_features), requires_grad=False))
        else:
            self.register_parameter("bias", None)

    lora = None   # workers/lora/layers.LoRALinear with --enable-lora

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor | PendingSum:
        """silu_mul: x is [T, 2I], gate and up side by side, and the input is silu(gate) * up
        (fused into the GEMV at decode sizes)."""
        gw = _gemv_weight(self, x) if self.quant_method is not None and self.tp == 1 and use_gemv(x) \
            and not _lora_active(self) else None
        if gw is not None:   # FP8 at decode rows: the SiLU fused into the GEMV, as for bf16
            return gemv(x, gw[0], self.bias, prologue="silu_mul" if silu_mul else "none", scale=gw[1])[0]
        if self.quant_method is not None:
            x = silu_and_mul(x) if silu_mul else x
            y = self.quant_method.apply(self, x, None)
            y = self.lora.add(x, y) if _lora_active(self) else y   # this rank's delta, before the sum
            y = y if self.tp == 1 else all_reduce(y)
            return y if self.bias is None else y + self.bias
        if _lora_active(self):
            return self.lora.row_forward(self, x, silu_mul)
        if use_gemv(x):
            prologue = "silu_mul" if silu_mul else "none"
            if self.tp == 1:
                return gemv(x, self.weight, self.bias, prologue=prologue)[0]
            y = linear_all_reduce(x, self.weight, lambda x, w, out=None: gemv(x, w, prologue=prologue, out=out)[0],
                                  norm_slot=self.norm_slot)
            return y if self.bias is None else y + self.bias
        if silu_mul:
            x = silu_and_mul(x)
        if self.tp == 1:
            return F.linear(x, self.weight, self.bias)
        y = linear_all_reduce(x, self.weight, norm_slot=self.norm_slot)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def _vocab_loader(vocab_size: int, vocab_start: int, param: nn.Parameter, loaded, shard_id=None) -> None:
    _check_shape(loaded, (vocab_size, param.shape[1]))
    part, start = param.shape[0], vocab_start
    rows = max(0, min(part, vocab_size - start))  # the last rank's padding rows stay zero
    param.data[:rows].copy_(_narrow(loaded, 0, start, rows))
    param.data[rows:].zero_()


class VocabParallelEmbedding(nn.Module):
    """The embedding (and the lm_head) with the vocabulary split over the ranks, padded so that
    it splits: rank r holds ids [r * part, (r + 1) * part). A lookup zeroes the ids of other
    ranks, then an all-reduce sums the ranks' rows; the lm_head's logits are gathered."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp, rank = tp_size(), tp_rank()
        self.vocab_size = vocab_size
        self.part = -(-vocab_size // self.tp)
        self.vocab_start = rank * self.part
        self.weight = nn.Parameter(torch.empty(self.part, hidden_size), requires_grad=False)
        _set_loader(self.weight, functools.partial(_vocab_loader, vocab_size, self.vocab_start), (vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(input_ids, self.weight)
        # each rank looks up its own rows (zeros for the others' ids): the sum is the lookup
        lookup = functools.partial(vocab_parallel_embedding, input_ids, self.weight, self.vocab_start)
        return all_reduce_written(lookup, input_ids.numel(), self.weight.shape[1], self.weight)

    def logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        """hidden [N, H] -> logits [N, vocab_size] on every rank (the ranks' parts gathered), or,
        when every row samples plainly and the parts are too large to gather in one shot, this
        rank's LogitsShard (workers/distributed.py)."""
        if self.tp == 1:
            return F.linear(hidden, self.weight)
        return lm_head_logits(hidden, self.weight, self.vocab_start, self.vocab_size, plain)
