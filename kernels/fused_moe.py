"""Mixture-of-experts: top-k routing and the experts' SiLU-gated MLPs, torch reference.

    out[t] = sum over j < k of  w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t, j]

with every expert's gate and up stacked as w13 [E, 2I, H] (gate rows first) and its down as
w2 [E, H, I] (vLLM's layout). An id of -1 names an expert that another rank holds (expert
parallelism, workers/models/moe.py): it contributes nothing here. This slice has the torch reference only: a per-expert gather of
the tokens routed to it, one matmul pair, and a scatter-add back. The Triton grouped-GEMM kernel
(tokens sorted and padded per expert into blocks, activation and top-k sum fused) and its
per-shape tuning are the next step of issue 45; the reference stays as its oracle."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, k] -> [T, H].
    The routed sum is accumulated in float32 and returned in hidden's dtype. An expert that
    no token chose costs nothing; the loop reads which experts were chosen (a host sync: the
    reference is for correctness, not for CUDA graphs)."""
    t, h = hidden.shape
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden.device)
    if t == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(t, device=hidden.device).repeat_interleave(topk_ids.shape[1])
    for e in flat_ids.unique().tolist():
        if e < 0:   # an expert on another rank (expert parallelism): nothing here
            continue
        pick = (flat_ids == e).nonzero(as_tuple=True)[0]
        tokens = token_of[pick]
        x = hidden[tokens]
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y.float() * flat_w[pick, None])
    return out.to(hidden.dtype)


def fused_moe_dense_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_ref's result with no host sync, for CUDA-graph capture until the Triton kernel
    lands: every expert runs on every token, weighted by its routing weight (0 where the token
    did not choose it). E / k times the routed FLOPs, so only for the small decode batches that
    graphs capture; the weights are each read once, as the routed path reads them."""
    t, h = hidden.shape
    # dense[t, e]: the routing weight of expert e for token t (0: not chosen)
    dense = torch.zeros((t, w13.shape[0]), dtype=torch.float32, device=hidden.device)
    here = topk_ids >= 0   # -1: an expert on another rank (expert parallelism), weight 0 here
    dense.scatter_add_(1, topk_ids.clamp(min=0), topk_weights.float() * here)
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        gate, up = F.linear(hidden, w13[e]).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, w2[e]).float() * dense[:, e:e + 1]
    return out.to(hidden.dtype)
