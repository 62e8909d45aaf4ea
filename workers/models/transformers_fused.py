"""The generic path's fused decoder layers: an HF pre-norm decoder layer (children
input_layernorm, self_attn, post_attention_layernorm, mlp; forward `x + attn(norm(x))`, then
`x + mlp(norm(x))`, Llama's) run as Loom's native layer runs, on HF's own submodules.

    use_fused_layers(hf, step)   replace each such layer's forward, where the whole decoder
                                 computes the same on a random input (checked at start-up);
                                 returns the number of layers fused (0: HF's forwards, logged)

The residual is carried beside the hidden states between layers (a FusedResidual the layers
share): each layer returns only its MLP's output and hands the sum to the next layer's
input norm, so every residual add is fused into the norm after it (layers.RMSNorm with a
residual: one kernel) and, at decode sizes, that add+norm into the next GEMV's prologue
(ColumnParallelLinear.forward_normed: the fused qkv_proj and gate_up_proj); the final norm
takes the last layer's sum. Per layer at batch 1 this saves the two residual adds and the two
norm launches, as the native Llama layer does (workers/models/blocks.py).

Refused (HF's forward kept): other structures (Gemma's sandwich norms, OLMo-2's post-norms,
Cohere's parallel blocks have other children), norms that are not Loom's RMSNorm (swapped in
by transformers.py where they compute the same), and any model on which the fused decoder's
output differs from HF's. LOOM_GENERIC_FUSED_LAYERS=0 switches it off (to time both).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ipc import envs
from workers.models.layers import RMSNorm

logger = logging.getLogger(__name__)

PRE_NORM_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


class FusedResidual:
    """The residual the last fused layer carried out, and the tensor it returned with it: a
    layer (or the final norm) whose input is that tensor adds the residual in its norm."""
    __slots__ = ("out", "residual")

    def __init__(self):
        self.out = self.residual = None

    def take(self, hidden: torch.Tensor) -> torch.Tensor | None:
        residual = self.residual if self.out is hidden else None
        self.out = self.residual = None
        return residual


def _normed_linear(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
    """(linear(norm(x + residual)), x + residual): layers.ColumnParallelLinear's forward_normed."""
    return linear.forward_normed(x, residual, norm)


def _attention(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, kwargs: dict):
    """self_attn(input_layernorm(x + residual)) and the new residual: with a fused qkv_proj the
    norm goes into its prologue and the q/k/v parts are primed with the result, keyed on the
    tensor the attention module passes to q_proj (x itself, unnormed, as a placeholder)."""
    attn, norm = layer.self_attn, layer.input_layernorm
    flat = x.reshape(-1, x.shape[-1])
    qkv = attn._modules.get("qkv_proj")
    if qkv is not None:
        out, residual = _normed_linear(qkv, flat, residual, norm)
        result = attn.q_proj.result
        result.x, result.parts, result.served = x, out.split(attn.q_proj.sizes, dim=-1), 0
        hidden = x
    else:
        normed, residual = (norm(flat), flat) if residual is None else norm(flat, residual)
        hidden = normed.view(x.shape)
    out, _ = attn(hidden_states=hidden, **kwargs)
    return out.reshape(-1, out.shape[-1]), residual


def _mlp(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """mlp(post_attention_layernorm(x + residual)) and the new residual; a FusedGatedMLP's
    gate_up_proj takes the norm in its prologue."""
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    gate_up = mlp._modules.get("gate_up_proj")
    if gate_up is not None and hasattr(mlp, "hidden_size"):   # transformers.FusedGatedMLP
        h, residual = _normed_linear(gate_up, x, residual, norm)
        return mlp.down_proj(h, silu_mul=True), residual
    normed, residual = norm(x, residual)
    return mlp(normed).reshape(-1, x.shape[-1]), residual


def fused_layer_forward(layer: nn.Module, carry: FusedResidual):
    """The forward that replaces `layer`'s: HF's call signature, returns the MLP output alone
    (the residual in `carry`, for the next layer or the final norm)."""
    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:   # (HF's layers pass all but the hidden states by keyword)
            raise TypeError("fused decoder layer: positional arguments after hidden_states")
        residual = carry.take(hidden_states)
        out, residual = _attention(layer, hidden_states, residual, kwargs)
        out, residual = _mlp(layer, out, residual)
        out = out.view(hidden_states.shape)
        carry.out, carry.residual = out, residual
        return out
    return forward


def fused_final_norm(norm: RMSNorm, carry: FusedResidual):
    def forward(x: torch.Tensor) -> torch.Tensor:
        residual = carry.take(x)
        flat = x.reshape(-1, x.shape[-1])
        out = RMSNorm.forward(norm, flat) if residual is None else RMSNorm.forward(norm, flat, residual)[0]
        return out.view(x.shape)
    return forward


def _sum_of(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else x + residual.view(x.shape)


def _pre_norm_layers(base: nn.Module) -> list[nn.Module] | None:
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not isinstance(getattr(base, "norm", None), RMSNorm):
        return None
    for layer in layers:
        if {n for n, _ in layer.named_children()} != PRE_NORM_CHILDREN:
            return None
        if not (isinstance(layer.input_layernorm, RMSNorm) and isinstance(layer.post_attention_layernorm, RMSNorm)):
            return None
    return list(layers)


def enabled() -> bool:
    return envs.LOOM_GENERIC_FUSED_LAYERS


@torch.inference_mode()
def _decoder_output(base: nn.Module, step, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's output on `input_ids`, each attention echoing its rotated queries
    (StepContext.echo): no KV cache, yet every layer's attention input and output count."""
    step.echo = True
    try:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return base(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state.float()
    finally:
        step.echo = False


@torch.no_grad()
def _seed_weights(base: nn.Module, norms: list[nn.Module], device: torch.device) -> None:
    """Seeded values in the decoder's weights for the check, which runs before they load: the
    fused q/k/v and gate/up projections are torch.empty then, whatever memory held (NaN included:
    the check failed at random, a CI flake). The norms get values away from 1, so that a skipped
    norm shows. The loader overwrites them all."""
    g = torch.Generator(device=device).manual_seed(2)
    for p in base.parameters():
        if p.dtype in (torch.float32, torch.float16, torch.bfloat16) and p.device == device:
            p.normal_(0.0, 0.02, generator=g)
    for n in norms:
        n.weight.uniform_(0.5, 1.5, generator=g)


def use_fused_layers(hf: nn.Module, step) -> int:
    """Fuse the decoder's layers where they have the pre-norm structure and the fused decoder
    computes what HF's does on random tokens; the number of layers fused (0: none, logged)."""
    base = hf.base_model
    layers = _pre_norm_layers(base)
    if not enabled() or layers is None:
        if layers is None:
            logger.info("generic path: %s is not a plain pre-norm decoder; HF's layer forwards kept",
                        type(base).__name__)
        return 0
    device = next(hf.parameters()).device
    vocab = hf.get_input_embeddings().weight.shape[0]
    # (on the CPU whatever the default device: the model may be built under torch.device("cuda"))
    ids = torch.randint(0, vocab, (1, 7), generator=torch.Generator().manual_seed(0), device="cpu").to(device)
    carry = FusedResidual()
    norms = [base.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    _seed_weights(base, norms, device)
    # compared before the final norm (a norm hides a layer's scale): HF's sum, and ours
    base.norm.forward = lambda x: x
    ref = _decoder_output(base, step, ids)
    for layer in layers:
        layer.forward = fused_layer_forward(layer, carry)
    base.norm.forward = lambda x: _sum_of(x, carry.take(x))
    try:
        ours = _decoder_output(base, step, ids)
        base.norm.forward = fused_final_norm(base.norm, carry)
        scale = ref.abs().max().clamp_min(1e-6)
        tol = 1e-5 if base.norm.weight.dtype == torch.float32 else 5e-2   # (fp32: only the adds' rounding differs)
        ok = bool(torch.isfinite(ours).all()) and float((ours - ref).abs().max() / scale) < tol
    except Exception as e:   # a layer whose attention or MLP is called otherwise
        logger.info("generic path: fused decoder layers failed on %s (%s)", type(base).__name__, e)
        ok = False
    if not ok:
        for layer in layers:
            layer.__dict__.pop("forward", None)
        base.norm.__dict__.pop("forward", None)
        logger.info("generic path: fused decoder layers differ from %s's; HF's layer forwards kept",
                    type(base).__name__)
        return 0
    hf.loom_fused_layers = len(layers)
    return len(layers)
