"""FusedMoE: the routed experts of a mixture-of-experts layer (vLLM's vocabulary).

Every expert's gate and up are stacked as w13_weight [E, 2I, H] (gate rows first) and its down
as w2_weight [E, H, I], so one call (kernels/fused_moe.py) runs all experts. Checkpoints name
each expert's tensors apart (`experts.{e}.gate_proj.weight`, Mixtral's `experts.{e}.w1.weight`);
`expert_params` gives the (fused, part, shard id) rewrites that route them to the stacked
parameters, shard id (expert, 0 gate | 1 up) for w13 and expert for w2.

Tensor parallelism splits every expert's intermediate dim (as vLLM does): w13's gate and up
rows by column, w2's columns by row; each rank's routed sum is partial, and one all-reduce
adds them. The router stays replicated (every rank routes every token alike)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from kernels.fused_moe import check_activation, fused_moe_dense_ref, fused_moe_ref
from workers.distributed import all_reduce, tp_rank, tp_size
from workers.models import layers
from workers.models.layers import _check_shape, _narrow, _set_loader, replicated


@torch.no_grad()
def _w13_loader(num_experts: int, part: int, rank: int, size: int, param: nn.Parameter, loaded,
                shard_id=None) -> None:
    """shard_id (e, j): expert e's gate (j 0) or up (j 1) [I, H], this rank's rows; None: the
    whole stacked [E, 2I, H] (dummy weights)."""
    if shard_id is None:
        for e in range(num_experts):
            for j in (0, 1):
                _w13_loader(num_experts, part, rank, size, param,
                            _narrow(loaded, 0, e, 1)[0].narrow(0, j * part * size, part * size), (e, j))
        return
    e, j = shard_id
    _check_shape(loaded, (part * size, param.shape[2]))
    param.data[e].narrow(0, j * part, part).copy_(_narrow(loaded, 0, rank * part, part))


@torch.no_grad()
def _w2_loader(num_experts: int, part: int, rank: int, size: int, param: nn.Parameter, loaded,
               shard_id=None) -> None:
    """shard_id e: expert e's down [H, I], this rank's columns; None: the whole [E, H, I]."""
    if shard_id is None:
        for e in range(num_experts):
            _w2_loader(num_experts, part, rank, size, param, _narrow(loaded, 0, e, 1)[0], e)
        return
    _check_shape(loaded, (param.shape[1], part * size))
    param.data[shard_id].copy_(_narrow(loaded, 1, rank * part, part))


@torch.no_grad()
def _w13_bias_loader(part: int, rank: int, size: int, param: nn.Parameter, loaded, shard_id=None) -> None:
    """The whole [E, 2I] gate/up bias (gate first): this rank's rows of each half."""
    _check_shape(loaded, (param.shape[0], 2 * part * size))
    for j in (0, 1):
        param.data.narrow(1, j * part, part).copy_(_narrow(loaded, 1, j * part * size + rank * part, part))


def expert_params(prefix: str, num_experts: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                  ) -> list[tuple[str, str, object]]:
    """Stacked-parameter rewrites for the experts under `prefix` (".mlp.experts."): the
    checkpoint's gate / up / down names (Mixtral: w1, w3, w2). They precede the dense blocks'
    (".gate_proj." would match an expert's name too)."""
    gate, up, down = names
    out = []
    for e in range(num_experts):
        out += [(f"{prefix}w13_weight", f"{prefix}{e}.{gate}.weight", (e, 0)),
                (f"{prefix}w13_weight", f"{prefix}{e}.{up}.weight", (e, 1)),
                (f"{prefix}w2_weight", f"{prefix}{e}.{down}.weight", e)]
    return out


class FusedMoE(nn.Module):
    """hidden [T, H], router_logits [T, E] -> the routed experts' weighted sum [T, H], summed
    over the ranks unless `reduce` is False (a caller that adds more partial sums first)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, scoring: str = "softmax", activation: str = "silu"):
        super().__init__()
        check_activation(activation)
        self.activation = activation
        # expert biases [E, 2I] / [E, H] (gate rows first, kernels/fused_moe.py): None, or
        # parameters (add_biases: gpt-oss)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if intermediate_size % tp_size():
            raise ValueError(f"FusedMoE: intermediate size {intermediate_size} not divisible by TP {tp_size()}")
        self.num_experts, self.top_k, self.renormalize, self.scoring = num_experts, top_k, renormalize, scoring
        part = intermediate_size // tp_size()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * part, hidden_size), requires_grad=False)
        _set_loader(self.w13_weight, functools.partial(_w13_loader, num_experts, part, tp_rank(), tp_size()),
                    (num_experts, 2 * intermediate_size, hidden_size),
                    tuple((e, j) for e in range(num_experts) for j in (0, 1)))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, part), requires_grad=False)
        _set_loader(self.w2_weight, functools.partial(_w2_loader, num_experts, part, tp_rank(), tp_size()),
                    (num_experts, hidden_size, intermediate_size), tuple(range(num_experts)))

    def add_biases(self) -> None:
        """Expert biases (gpt-oss): w13_bias [E, 2I / TP] (gate first, this rank's part of each
        half) and w2_bias [E, H] (every rank holds it), loaded from whole [E, 2I] / [E, H]
        tensors. Under TP the ranks' routed sums are partial, so forward adds the down bias on
        rank 0 only (the all-reduce then adds it once)."""
        e, part, h = self.num_experts, self.w2_weight.shape[2], self.w2_weight.shape[1]
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * part), requires_grad=False)
        _set_loader(self.w13_bias, functools.partial(_w13_bias_loader, part, tp_rank(), tp_size()),
                    (e, 2 * part * tp_size()))
        self.w2_bias = replicated(nn.Parameter(torch.empty(e, h), requires_grad=False))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        weights, ids = layers.select_experts(router_logits, self.top_k, self.renormalize, self.scoring)
        # layers.fused_moe: the Triton kernel on the Triton path (sync-free: graphs capture it),
        # the routed reference otherwise; that one reads which experts were chosen (a host
        # sync), so a CUDA-graph capture on the reference path runs the dense, sync-free one
        moe = layers.fused_moe
        if moe is fused_moe_ref and hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            moe = fused_moe_dense_ref
        # each rank's routed sum is partial (its share of the intermediate dim): the down bias
        # joins one rank's only, so that the all-reduce adds it once
        w2_bias = self.w2_bias if tp_rank() == 0 else None
        out = moe(hidden, self.w13_weight, self.w2_weight, weights, ids, w13_bias=self.w13_bias,
                  w2_bias=w2_bias, activation=self.activation)
        return all_reduce(out) if reduce else out


class Router(nn.Module):
    """The replicated gate: hidden [T, H] -> router logits [T, E] (HF's `gate.weight`)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = replicated(nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)
