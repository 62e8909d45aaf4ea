"""The generic path (vLLM's "Transformers backend"): any decoder-only `*ForCausalLM` that
transformers 5.x implements, run as HF wrote it, with Loom's paged attention plugged in
through transformers' attention interface (`--model-impl transformers`, or `auto` for an
architecture without a file of its own here).

    TransformersForCausalLM(config)   the HF model built from the config (`attn_implementation="loom"`)
    forward(input_ids, positions, ...) the HF base model on all of the step's tokens as one row
                                      [1, T], `position_ids` = Loom's positions, no HF cache
    loom_attention(module, q, k, v)   in place of HF's attention: k and v into layer
                                      `module.layer_idx`'s paged cache, then workers.attention

Each HF attention module computes q, k, v and rotates them itself (its own rotary, from the
position ids), then calls the function registered under its `config._attn_implementation`;
"loom" is ours. No attention-mask function is registered under "loom", so transformers' mask
builders return None at once (`_preprocess_mask_arguments`): no O(T^2) mask, no host sync.
The kernel is causal over the paged cache, per sequence, which is what the mask would say.

The step's metadata and caches reach the attention function through a StepContext that the
model sets in forward and that every attention module holds (`module.loom_step`); each layer's
attention goes through its own workers.attention.Attention (`module.loom_attn`), so the
piecewise CUDA graphs split there as in a native model (workers/piecewise_graphs.py).

Speed: an HF module that computes what a Loom layer computes runs as that layer (checked on
random inputs at start-up; Parameters shared, names unchanged but for the fused gate_up):
RMSNorms as layers.RMSNorm (one Triton kernel), gated MLPs down(silu(gate(x)) * up(x)) as
FusedGatedMLP (one gate_up matmul, one fused SiLU-and-multiply), q_proj/k_proj/v_proj as views
of one fused qkv_proj (FusedQKVPart), the other nn.Linears as GemvLinear (the decode GEMV), and
on the GPU the modeling module's `apply_rotary_pos_emb` as one kernel (kernels/rotary_apply.py).
Where the decoder layers are Llama's pre-norm ones, their forward is replaced by Loom's (the
same submodules; the residual carried beside, each add fused into the next norm and GEMV:
workers/models/transformers_fused.py).

Served: the final-logit soft cap (`final_logit_softcapping`, Gemma 2 style), Cohere's
`logit_scale` (logits * scale) and Granite's `logits_scaling` (logits / scaling); a model
whose forward does anything else to the logits is served without it. Not served (refused at
start-up by workers/models/registry.py): encoder-decoders, multimodal models, models whose
attention does not go through the interface (`_supports_attention_backend` False: recurrent
and hybrid state such as Mamba, RWKV, Jamba, Falcon's own attention), and tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM

from kernels.kv_cache_write import write_kv_cache
from kernels.rotary_apply import apply_rotary
from kernels.paged_attention import write_kv_cache_ref
from kernels.rms_norm import rms_norm_ref
from workers.attention import Attention, AttentionMetadata
from workers.models import layers
from workers.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, Shard, split_shards
from workers.models.transformers_fused import use_fused_layers
from workers.models.weights import load_weights

ATTN_IMPLEMENTATION = "loom"


@dataclass
class StepContext:
    """What the attention function needs of the step: set by the model's forward, read by
    each layer's attention call (while a CUDA graph is captured, the graph's own buffers)."""
    meta: AttentionMetadata | None = None
    kv_caches: list = field(default_factory=list)
    probe: dict | None = None   # while set: layer index -> (query heads, KV heads, head size), recorded
    echo: bool = False          # while set: attention returns its rotated queries (start-up checks)


def loom_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, scaling: float | None = None, dropout: float = 0.0,
                   sliding_window: int | None = None, softcap: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, Hq, T, D] and key/value
    [1, Hkv, T, D] (rotated by the HF module) -> ([1, T, Hq, D], no weights)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported on the generic path")
    step: StepContext = module.loom_step
    if step.probe is not None:  # start-up: the layer's head counts and head size, no attention
        step.probe[module.layer_idx] = (query.shape[1], key.shape[1], query.shape[-1])
        return query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3]), None
    if step.echo:   # start-up check of the fused layers (transformers_fused.py): no cache, no kernel; a
        # bounded function of q, k and v (each shows a wrong slice), so that the stream stays O(1) over layers
        out = torch.tanh(query) + torch.tanh(key).mean(1, keepdim=True) + torch.tanh(value).mean(1, keepdim=True)
        return out.transpose(1, 2).contiguous(), None
    attn = module._modules.get("loom_attn")
    if attn is None:  # the first call (start-up's profiling run): the layer's own head counts and scale
        attn = module.loom_attn = Attention(query.shape[1], key.shape[1], query.shape[-1],
                                            query.shape[-1] ** -0.5 if scaling is None else scaling,
                                            sliding_window=sliding_window, logits_soft_cap=softcap).to(query.device)
    kv_cache = step.kv_caches[module.layer_idx]
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, heads, D]
    meta = step.meta
    write = write_kv_cache if meta.backend == "triton" else write_kv_cache_ref
    if meta.calculate_kv_scales:
        attn.calculate_kv_scales(k, v)
    write(k, v, *kv_cache, meta.slot_mapping, attn.k_scale, attn.v_scale)
    out = attn(q, kv_cache, meta)   # [T, Hq * D]
    return out.view(1, q.shape[0], q.shape[1], q.shape[2]), None


AttentionInterface.register(ATTN_IMPLEMENTATION, loom_attention)


@torch.no_grad()
def _copy_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """The whole tensor (the generic path has no tensor parallelism); a safetensors slice is
    read here."""
    shape = tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)
    if shape != tuple(param.shape):
        raise ValueError(f"checkpoint shape {shape} != expected {tuple(param.shape)}")
    param.data.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded[...])


class GemvLinear(nn.Module):
    """nn.Linear (the same weight and bias Parameters) through Loom's linear path: the decode
    GEMV (kernels/gemv.py) at decode-sized batches on the Triton path, else F.linear."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = layers.gemv(x2, self.weight, self.bias)[0] if layers.use_gemv(x2) else F.linear(x2, self.weight, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def _rms_norm_like_loom(module: nn.Module, eps: float) -> bool:
    """Whether an HF norm computes Loom's RMSNorm (Llama's: fp32 statistics, weight * x): checked
    on a random input and weight, so Gemma's (1 + weight), a LayerNorm or a gated norm stay HF's."""
    w = module.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.copy_(torch.rand_like(w) + 0.5)
            x = torch.randn(3, w.shape[0], dtype=w.dtype, device=w.device)
            ok = torch.allclose(module(x).float(), rms_norm_ref(x, w, eps).float(), rtol=1e-2, atol=1e-2)
    except Exception:   # a norm with another signature (gated): HF's own
        ok = False
    finally:
        with torch.no_grad():
            w.copy_(saved)
    return ok


class FusedGatedMLP(nn.Module):
    """An HF gated MLP, down(silu(gate(x)) * up(x)), as Loom's: gate and up fused into one
    projection (the checkpoint's gate_proj / up_proj load into it as shards, GATE_UP_PARTS), the
    SiLU-and-multiply one kernel (fused into down's GEMV at decode sizes). 5 kernels -> 3."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        inter, hidden = gate.weight.shape
        self.hidden_size = hidden
        self.gate_up_proj = ColumnParallelLinear(hidden, split_shards({0: inter, 1: inter}, 0, 1), gate.bias is not None)
        self.down_proj = RowParallelLinear(inter, hidden, down.bias is not None, norm_slot=None)
        with torch.no_grad():   # HF's initial values: the check below compares the two on them
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias]))
            self.down_proj.weight.copy_(down.weight)
            if down.bias is not None:
                self.down_proj.bias.copy_(down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(self.gate_up_proj(x.reshape(-1, self.hidden_size)), silu_mul=True)
        return y.view(*x.shape[:-1], y.shape[-1])


# (fused parameter, checkpoint part, shard id) of FusedGatedMLP, for weights.load_weights
GATE_UP_PARTS = [(".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1)]


def _fuse_gated_mlps(hf: nn.Module) -> bool:
    """Replace every module whose children are exactly gate_proj, up_proj, down_proj (nn.Linear)
    and act_fn by a FusedGatedMLP, where each computes the same on a random input (a GELU or
    another form stays HF's); all or none, as the checkpoint-name rewrite applies to all."""
    mlps = [(parent, name, child) for parent in hf.modules() for name, child in parent.named_children()
            if {n for n, _ in child.named_children()} == {"gate_proj", "up_proj", "down_proj", "act_fn"}
            and all(type(getattr(child, n)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))]
    if not mlps or any(".gate_proj." in n or ".up_proj." in n for n, _ in hf.named_parameters()
                       if not any(n.startswith(f"{m}.") for m in _names_of(hf, [c for _, _, c in mlps]))):
        return False
    fused = []
    for parent, name, mlp in mlps:
        new = FusedGatedMLP(mlp)
        w = mlp.gate_proj.weight
        x = torch.randn(3, new.hidden_size, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            if not torch.allclose(new(x).float(), mlp(x).float(), rtol=1e-2, atol=1e-3):
                return False
        fused.append((parent, name, new))
    for parent, name, new in fused:
        setattr(parent, name, new)
    return True


class _QKVResult:
    """The fused projection's last input and its q, k, v parts, until all three are served."""
    __slots__ = ("x", "parts", "served")

    def __init__(self):
        self.x, self.parts, self.served = None, None, 0


class FusedQKVPart(nn.Module):
    """q_proj, k_proj or v_proj of an HF attention module, served from one fused qkv_proj
    (registered on the attention module, `ColumnParallelLinear` with shards q, k, v): the first
    of the three called with an input runs the one matmul, the other two take their slices of
    it. An input the fused result was not computed from (an HF module that projects q, k and v
    from different tensors) runs the matmul again: always exact, one GEMM instead of three in
    the usual case."""

    def __init__(self, fused: ColumnParallelLinear, index: int, sizes: list[int], result: _QKVResult):
        super().__init__()
        self.__dict__["_fused"] = fused   # not a child: its parameters are the attention module's
        self.index, self.sizes, self.result = index, sizes, result
        self.in_features, self.out_features = fused.in_features, sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.result
        if r.x is not x:
            r.x, r.served = x, 0
            r.parts = self._fused(x.reshape(-1, x.shape[-1])).split(self.sizes, dim=-1)
        out = r.parts[self.index]
        r.served += 1
        if r.served == 3:   # all three served: hold no activation past the layer
            r.x = r.parts = None
        return out.view(*x.shape[:-1], out.shape[-1])


QKV_PARTS = [(".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v")]


def _fuse_qkv(hf: nn.Module) -> bool:
    """Give every attention module whose q_proj, k_proj and v_proj are nn.Linears of one input
    size (and alike in bias) one fused qkv_proj, the three becoming FusedQKVPart views of it; all
    or none, as the checkpoint-name rewrite (QKV_PARTS) applies to every name."""
    attns = [m for m in hf.modules() if isinstance(getattr(m, "layer_idx", None), int)
             and all(type(getattr(m, n, None)) is nn.Linear for n in ("q_proj", "k_proj", "v_proj"))]
    projs = [[getattr(m, n) for n in ("q_proj", "k_proj", "v_proj")] for m in attns]
    if not attns or any(len({p.in_features for p in ps}) != 1 or len({p.bias is None for p in ps}) != 1
                        for ps in projs):
        return False
    fused_names = {f"{n}." for n in _names_of(hf, attns)}
    if any(any(f".{p}." in n for p in ("q_proj", "k_proj", "v_proj")) and not any(n.startswith(f) for f in fused_names)
           for n, _ in hf.named_parameters()):
        return False   # a q/k/v projection elsewhere would be renamed too
    for attn, (q, k, v) in zip(attns, projs):
        sizes = [q.out_features, k.out_features, v.out_features]
        shards = {"q": Shard(sizes[0], 0, sizes[0], 0), "k": Shard(sizes[1], 0, sizes[1], sizes[0]),
                  "v": Shard(sizes[2], 0, sizes[2], sizes[0] + sizes[1])}
        fused = ColumnParallelLinear(q.in_features, shards, q.bias is not None)
        attn.qkv_proj = fused
        result = _QKVResult()
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            setattr(attn, name, FusedQKVPart(fused, i, sizes, result))
    return True


def _names_of(root: nn.Module, modules: list) -> list[str]:
    ids = {id(m) for m in modules}
    return [n for n, m in root.named_modules() if id(m) in ids]


def _use_loom_layers(hf: nn.Module) -> None:
    """Swap HF's RMSNorms that compute Loom's for layers.RMSNorm (one Triton kernel on the GPU
    instead of seven torch ops) and its nn.Linears, the lm_head aside, for GemvLinear. The
    Parameters are the same objects (names and loading unchanged); nothing else of HF's changes."""
    lm_head = hf.get_output_embeddings()
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not lm_head:
                setattr(parent, name, GemvLinear(child))
                continue
            eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
            w = getattr(child, "weight", None)
            if ("RMSNorm" in type(child).__name__ and isinstance(eps, float) and isinstance(w, nn.Parameter)
                    and w.dim() == 1 and not list(child.children()) and _rms_norm_like_loom(child, eps)):
                norm = RMSNorm(w.shape[0], eps)
                norm.weight = w
                setattr(parent, name, norm)


def _rotary_matches(original, partial: bool, device: torch.device) -> bool:
    """Whether an HF `apply_rotary_pos_emb(q, k, cos, sin)` computes kernels/rotary_apply.py's
    (NeoX style; `partial`: with cos narrower than the head, the rest passed through), on
    random fp32 inputs on the device."""
    g = torch.Generator(device=device).manual_seed(0)
    # float32 whatever the default dtype the model is built under (bf16 would round HF's ops apart)
    q, k = (torch.randn(1, h, 5, 64, generator=g, device=device, dtype=torch.float32) for h in (4, 2))
    cos, sin = (torch.randn(1, 5, 32 if partial else 64, generator=g, device=device, dtype=torch.float32)
                for _ in range(2))
    try:
        ref = original(q, k, cos, sin)
    except Exception:   # another signature, or no partial rotary
        return False
    ours = apply_rotary(q, k, cos, sin)
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(ref, ours))


def _use_fused_rotary(hf: nn.Module, device: torch.device) -> None:
    """Route the attention modules' `apply_rotary_pos_emb` (a function of their modeling module)
    through one kernel where it computes the same: at decode sizes HF's ten elementwise launches
    per layer cost more than the math. Only on the GPU; the modeling module's function is
    replaced for the process (the worker), falling back to HF's for any other call shape."""
    if device.type != "cuda":
        return
    import sys
    for name in {type(m).__module__ for m in hf.modules() if isinstance(getattr(m, "layer_idx", None), int)}:
        mod = sys.modules.get(name)
        original = getattr(mod, "apply_rotary_pos_emb", None)
        if original is None or hasattr(original, "loom_original") or not _rotary_matches(original, False, device):
            continue
        partial_ok = _rotary_matches(original, True, device)

        def apply_rotary_pos_emb(q, k, cos, sin, *args, _original=original, _partial=partial_ok, **kwargs):
            if (args or kwargs or not q.is_cuda or q.dim() != 4 or cos.dim() != 3 or q.shape[0] != 1
                    or (cos.shape[-1] != q.shape[-1] and not _partial)):
                return _original(q, k, cos, sin, *args, **kwargs)
            return apply_rotary(q, k, cos, sin)
        apply_rotary_pos_emb.loom_original = original
        mod.apply_rotary_pos_emb = apply_rotary_pos_emb


def _checkpoint_renamings(hf: nn.Module) -> list:
    """The checkpoint names transformers renames on load (GPT-NeoX's embed_out -> lm_head, ...):
    its WeightRenamings (transformers >= 5; a tensor-merging WeightConverter, such as fused MoE
    experts, is not applied: such a checkpoint's names then match no parameter, and say so)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:   # transformers 4: checkpoints carry the modules' names
        return []
    return [t for t in get_model_conversion_mapping(hf) if isinstance(t, WeightRenaming)]


def _rename(name: str, renamings: list) -> str:
    """A checkpoint name after transformers' renamings. Its API moved within 5.x: the newest has
    apply_renamings / WeightRenaming.rename_source_key, earlier ones the module's
    rename_source_key(key, renamings, converters)."""
    import transformers.core_model_loading as cml
    if hasattr(renamings[0], "rename_source_key"):
        for renaming in renamings:
            name = renaming.rename_source_key(name)[0]
        return name
    return cml.rename_source_key(name, renamings, [])[0]


class TransformersForCausalLM(nn.Module):
    """An HF `*ForCausalLM` under Loom's model contract (workers/models/interfaces.py). Its
    children are the HF model's own (e.g. `model` and `lm_head`), so the parameter names are
    the checkpoint's."""
    stacked_params: ClassVar[list] = []   # per instance: GATE_UP_PARTS where the MLPs are fused

    def __init__(self, config):
        super().__init__()
        self.config = config
        # built under the device and default dtype the loader sets (workers/model_loader.py)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype(),
                                              attn_implementation=ATTN_IMPLEMENTATION)
        # gated MLPs fused as Loom's where they compute the same (their gate/up load as shards)
        self.stacked_params = GATE_UP_PARTS if _fuse_gated_mlps(hf) else []
        # and q, k, v as one projection where the attention modules have the three
        self.stacked_params = self.stacked_params + (QKV_PARTS if _fuse_qkv(hf) else [])
        _use_loom_layers(hf)
        _use_fused_rotary(hf, next(hf.parameters()).device)
        for name, child in hf.named_children():
            self.add_module(name, child)
        # not children (their modules are registered above): the base model and the lm_head
        self.__dict__["_decoder"] = hf.base_model
        self.__dict__["_lm_head"] = hf.get_output_embeddings()
        self.tie_word_embeddings = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
        self.step = StepContext()
        for m in hf.modules():
            if isinstance(getattr(m, "layer_idx", None), int):
                m.loom_step = self.step   # (a plain attribute: the attention function reads it)
        # Llama-style pre-norm layers as Loom's: residual adds fused into the next norm / GEMV
        self.fused_layers = use_fused_layers(hf, self.step)
        text = config.get_text_config()
        self.final_logit_softcapping = getattr(text, "final_logit_softcapping", None)
        self.logit_scale = getattr(text, "logit_scale", None)        # Cohere: logits * scale
        self.logits_scaling = getattr(text, "logits_scaling", None)  # Granite: logits / scaling
        # every tensor is one checkpoint tensor, loaded whole; names that alias another's
        # tensor (a tied lm_head) are loaded once, under the first name
        self._aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in first:
                self._aliases[name] = first[id(p)]
                continue
            first[id(p)] = name
            if not hasattr(p, "weight_loader"):   # (a FusedGatedMLP's parameters have Loom's)
                p.weight_loader, p.full_shape, p.shard_ids = _copy_loader, tuple(p.shape), (None,)
        self._params = set(first.values())
        self._prefix = hf.base_model_prefix
        self._renamings = _checkpoint_renamings(hf)
        self._buffers_named = {name for name, _ in self.named_buffers()}
        self.kv_cache_shape = self._probe_kv_shape()   # (workers/model_loader.py kv_cache_shape)
        for m in self.modules():   # norm weights start at 1 with dummy weights (workers/model_loader.py)
            w = getattr(m, "weight", None)
            if "Norm" in type(m).__name__ and isinstance(w, nn.Parameter) and w.dim() == 1:
                w.dummy_value = 1.0

    @torch.inference_mode()
    def _probe_kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head size) of the KV cache, as the attention modules call the
        interface (a config's head counts are not always the modules': multi-query GPTBigCode,
        models without num_key_value_heads): one token through the model, attention skipped."""
        self.step.probe = {}
        try:
            one = torch.zeros(1, dtype=torch.long, device=next(self.parameters()).device)
            self._decoder(input_ids=one[None], position_ids=one[None], use_cache=False)
            shapes = self.step.probe
        finally:
            self.step.probe = None
        if not shapes:
            raise ValueError(f"{type(self._decoder).__name__} called no attention through transformers' "
                             "attention interface; the generic path cannot serve it")
        if sorted(shapes) != list(range(len(shapes))) or len(set(shapes.values())) != 1:
            raise ValueError(f"the generic path needs every layer's attention alike (one KV-cache shape); "
                             f"got {shapes}")
        _, kv_heads, head_dim = shapes[0]
        return len(shapes), kv_heads, head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        """Flattened (varlen) tokens of all sequences -> final hidden states [T, hidden]."""
        self.step.meta, self.step.kv_caches = meta, kv_caches
        out = self._decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                            return_dict=True)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor:
        logits = self._lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def hf_to_loom(self, name: str) -> str | None:
        """The checkpoint's names are ours; a buffer (rotary inv_freq, a causal-mask constant)
        and a tied alias are not loaded. A name without the base model's prefix (older
        checkpoints of some architectures) gets it."""
        if self._renamings:
            name = _rename(name, self._renamings)
        if name in self._aliases or name in self._buffers_named:
            return None
        if name not in self._params and f"{self._prefix}.{name}" in self._params:
            return f"{self._prefix}.{name}"
        return name

    def load_weights(self, weights: Iterable[tuple[str, object]], partial: bool = False) -> set[str]:
        return load_weights(self, weights, partial)
