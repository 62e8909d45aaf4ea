"""Mixture-of-experts: top-k routing and the experts' gated MLPs, torch references.

    out[t] = sum over j < k of  w[t, j] * (down_e(act(gate_e(x_t), up_e(x_t))) + b2_e),  e = ids[t, j]

Layout (vLLM's): every expert's gate and up are stacked as w13 [E, 2I, H], **gate rows first,
then up rows** (with its optional bias w13_bias [E, 2I] in the same order), and its down as
w2 [E, H, I] (optional bias w2_bias [E, H], added before the routing weight scales the expert's
output, as HF's gpt-oss does). One layout for every model: gpt-oss's checkpoint interleaves
gate and up (gate_up_proj[..., 0::2] is the gate, [..., 1::2] the up), and its loader
de-interleaves at load (`deinterleave_gate_up`) so the kernels never see the interleaved form.

Activations, act(gate, up):
  "silu"      SwiGLU, silu(gate) * up (Qwen-MoE, Mixtral);
  "swigluoai" gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate):
              gate = min(gate, 7.0); up = clamp(up, -7.0, 7.0);
              (up + 1) * gate * sigmoid(1.702 * gate).

The references: fused_moe_ref gathers the tokens routed to each chosen expert (it reads which
experts were chosen: a host sync), fused_moe_dense_ref runs every expert on every token
(sync-free). The Triton grouped-GEMM kernel is their fast equal."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# gpt-oss's clamped SwiGLU constants (its config's swiglu_alpha / swiglu_limit, fixed in vLLM too)
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
ACTIVATIONS = ("silu", "swigluoai")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64).
    scoring: "softmax" over all experts, or "sigmoid" per expert; renormalize: the k chosen
    weights are scaled to sum to 1 (Mixtral always; Qwen's `norm_topk_prob`). The scores are
    taken in float32, as HF does, so near-ties pick the same experts."""
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"select_experts: unknown scoring {scoring!r} (softmax, sigmoid)")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: unknown activation {activation!r} ({', '.join(ACTIVATIONS)})")


def moe_act_ref(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> act(gate, up) [..., I] in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    check_activation(activation)
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's interleaved gate/up (gate at even, up at odd indices of `dim`) -> [gate; up]
    along `dim`, the layout w13 and w13_bias use."""
    idx = torch.arange(t.shape[dim], device=t.device)
    return t.index_select(dim, torch.cat([idx[0::2], idx[1::2]]))


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, e: int, w13_bias, w2_bias,
                activation: str) -> torch.Tensor:
    """Expert e on x [n, H] -> [n, H]."""
    gate_up = F.linear(x, w13[e], None if w13_bias is None else w13_bias[e])
    return F.linear(moe_act_ref(gate_up, activation), w2[e], None if w2_bias is None else w2_bias[e])


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, k] -> [T, H];
    optional biases w13_bias [E, 2I], w2_bias [E, H]; activation "silu" or "swigluoai".
    The routed sum is accumulated in float32 and returned in hidden's dtype. An expert that
    no token chose costs nothing; the loop reads which experts were chosen (a host sync: the
    reference is for correctness, not for CUDA graphs)."""
    check_activation(activation)
    t, h = hidden.shape
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden.device)
    if t == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(t, device=hidden.device).repeat_interleave(topk_ids.shape[1])
    for e in flat_ids.unique().tolist():
        pick = (flat_ids == e).nonzero(as_tuple=True)[0]
        tokens = token_of[pick]
        y = _expert_mlp(hidden[tokens], w13, w2, e, w13_bias, w2_bias, activation)
        out.index_add_(0, tokens, y.float() * flat_w[pick, None])
    return out.to(hidden.dtype)


def fused_moe_dense_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """fused_moe_ref's result with no host sync: every expert runs on every token, weighted by
    its routing weight (0 where the token did not choose it). E / k times the routed FLOPs: the
    CPU path under capture-like conditions and an oracle, not a fast path."""
    check_activation(activation)
    t, h = hidden.shape
    # dense[t, e]: the routing weight of expert e for token t (0: not chosen)
    dense = torch.zeros((t, w13.shape[0]), dtype=torch.float32, device=hidden.device)
    dense.scatter_add_(1, topk_ids, topk_weights.float())
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        out += _expert_mlp(hidden, w13, w2, e, w13_bias, w2_bias, activation).float() * dense[:, e:e + 1]
    return out.to(hidden.dtype)
