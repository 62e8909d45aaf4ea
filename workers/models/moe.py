"""FusedMoE: the routed experts of a mixture-of-experts layer (vLLM's vocabulary).

Every expert's gate and up are stacked as w13_weight [E, 2I, H] (gate rows first) and its down
as w2_weight [E, H, I], so one call (kernels/fused_moe.py) runs all experts. Checkpoints name
each expert's tensors apart (`experts.{e}.gate_proj.weight`, Mixtral's `experts.{e}.w1.weight`);
`expert_params` gives the (fused, part, shard id) rewrites that route them to the stacked
parameters, shard id (expert, 0 gate | 1 up) for w13 and expert for w2.

Tensor parallelism splits every expert's intermediate dim (as vLLM does): w13's gate and up
rows by column, w2's columns by row; each rank's routed sum is partial, and one all-reduce
adds them. The router stays replicated (every rank routes every token alike).

Expert parallelism (--enable-expert-parallel) places whole experts on ranks instead (the
tensor-parallel ranks reused, as vLLM's EP; attention stays tensor-parallel): rank r holds a
contiguous block of experts (`ExpertPlacement`, vLLM's linear placement: uneven counts give
the first E % N ranks one more). Every rank still routes every token; the ids of experts held
elsewhere become -1 (`expert_map`), which the kernels skip, so a rank's sum covers its own
experts only and the same all-reduce adds the ranks' sums. Loading copies only the rank's
experts (another rank's checkpoint tensors are never read), so each rank holds E / N of the
expert weights, whole, where TP holds a 1/N slice of every expert."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from kernels.fused_moe import check_activation, fused_moe_dense_ref, fused_moe_ref
from workers.distributed import all_reduce, ep_rank, ep_size, tp_rank, tp_size
from workers.models import layers
from workers.models.layers import _check_shape, _narrow, _set_loader, replicated


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts one rank holds: [first, first + count) of num_experts, stored at 0..count-1."""
    num_experts: int
    first: int
    count: int

    @classmethod
    def of_rank(cls, num_experts: int, rank: int, size: int) -> "ExpertPlacement":
        """Contiguous blocks, the first num_experts % size ranks one expert more (vLLM's
        "linear" placement); size 1: every expert."""
        base, extra = divmod(num_experts, size)
        return cls(num_experts, rank * base + min(rank, extra), base + (rank < extra))

    def local(self, e: int) -> int | None:
        """Where global expert e is stored here (None: on another rank)."""
        return e - self.first if self.first <= e < self.first + self.count else None

    def expert_map(self) -> torch.Tensor:
        """[num_experts] int64: global id -> local id, -1 for another rank's expert."""
        m = torch.full((self.num_experts,), -1, dtype=torch.int64)
        m[self.first:self.first + self.count] = torch.arange(self.count)
        return m


@torch.no_grad()
def _w13_loader(experts: ExpertPlacement, part: int, rank: int, size: int, param: nn.Parameter, loaded,
                shard_id=None) -> None:
    """shard_id (e, j): expert e's gate (j 0) or up (j 1) [I, H], this rank's rows (nothing
    when expert e is another rank's); None: the whole stacked [E, 2I, H] (dummy weights).
    rank / size: the intermediate dim's split (1 under expert parallelism)."""
    if shard_id is None:
        _check_shape(loaded, (experts.num_experts, 2 * part * size, param.shape[2]))
        for e in range(experts.first, experts.first + experts.count):
            for j in (0, 1):
                _w13_loader(experts, part, rank, size, param,
                            _narrow(loaded, 0, e, 1)[0].narrow(0, j * part * size, part * size), (e, j))
        return
    e, j = shard_id
    _check_shape(loaded, (part * size, param.shape[2]))
    here = experts.local(e)
    if here is not None:
        param.data[here].narrow(0, j * part, part).copy_(_narrow(loaded, 0, rank * part, part))


@torch.no_grad()
def _w2_loader(experts: ExpertPlacement, part: int, rank: int, size: int, param: nn.Parameter, loaded,
               shard_id=None) -> None:
    """shard_id e: expert e's down [H, I], this rank's columns (nothing when expert e is another
    rank's); None: the whole [E, H, I]."""
    if shard_id is None:
        _check_shape(loaded, (experts.num_experts, param.shape[1], part * size))
        for e in range(experts.first, experts.first + experts.count):
            _w2_loader(experts, part, rank, size, param, _narrow(loaded, 0, e, 1)[0], e)
        return
    _check_shape(loaded, (param.shape[1], part * size))
    here = experts.local(shard_id)
    if here is not None:
        param.data[here].copy_(_narrow(loaded, 1, rank * part, part))


@torch.no_grad()
def _w13_bias_loader(experts: ExpertPlacement, part: int, rank: int, size: int, param: nn.Parameter, loaded,
                     shard_id=None) -> None:
    """The whole [E, 2I] gate/up bias (gate first): this rank's experts, their rows of each half."""
    _check_shape(loaded, (experts.num_experts, 2 * part * size))
    mine = _narrow(loaded, 0, experts.first, experts.count)
    for j in (0, 1):
        param.data.narrow(1, j * part, part).copy_(_narrow(mine, 1, j * part * size + rank * part, part))


@torch.no_grad()
def _w2_bias_loader(experts: ExpertPlacement, param: nn.Parameter, loaded, shard_id=None) -> None:
    """The whole [E, H] down bias: this rank's experts (whole rows: the bias follows the sum)."""
    _check_shape(loaded, (experts.num_experts, param.shape[1]))
    param.data.copy_(_narrow(loaded, 0, experts.first, experts.count))


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
        # parameters that add_biases registers (gpt-oss)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        self.num_experts, self.top_k, self.renormalize, self.scoring = num_experts, top_k, renormalize, scoring
        # expert parallelism: whole experts per rank; else every expert, its intermediate dim split
        self.placement = ExpertPlacement.of_rank(num_experts, ep_rank(), ep_size())
        self.i_rank, self.i_size = (0, 1) if ep_size() > 1 else (tp_rank(), tp_size())
        if intermediate_size % self.i_size:
            raise ValueError(f"FusedMoE: intermediate size {intermediate_size} not divisible by TP {self.i_size} "
                             f"(--enable-expert-parallel places whole experts instead)")
        self.intermediate_size = intermediate_size
        part = intermediate_size // self.i_size
        local = self.placement.count
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * part, hidden_size), requires_grad=False)
        _set_loader(self.w13_weight, functools.partial(_w13_loader, self.placement, part, self.i_rank, self.i_size),
                    (num_experts, 2 * intermediate_size, hidden_size),
                    tuple((e, j) for e in range(num_experts) for j in (0, 1)))
        self.w13_weight.part_shape = (intermediate_size, hidden_size)   # a checkpoint's gate / up (weight updates)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, part), requires_grad=False)
        _set_loader(self.w2_weight, functools.partial(_w2_loader, self.placement, part, self.i_rank, self.i_size),
                    (num_experts, hidden_size, intermediate_size), tuple(range(num_experts)))
        self.w2_weight.part_shape = (hidden_size, intermediate_size)
        # global expert id -> local (-1: another rank's), None without expert parallelism
        self.register_buffer("expert_map", self.placement.expert_map().to(self.w13_weight.device)
                             if self.placement.count < num_experts else None, persistent=False)

    def add_biases(self) -> None:
        """Expert biases (gpt-oss): w13_bias [local E, 2I / TP] (gate first) and w2_bias [local E, H],
        loaded from whole [E, 2I] / [E, H] tensors. The down bias joins the routed sum on
        i_rank 0 only (under TP the ranks' sums are partial, so it must be added once; under EP
        every rank adds its own experts' biases, each expert being on one rank): forward passes
        w2_bias only where self.i_rank == 0."""
        part, local = self.w2_weight.shape[2], self.placement.count
        self.w13_bias = nn.Parameter(torch.empty(local, 2 * part), requires_grad=False)
        _set_loader(self.w13_bias, functools.partial(_w13_bias_loader, self.placement, part, self.i_rank,
                                                     self.i_size), (self.num_experts, 2 * self.intermediate_size))
        self.w2_bias = nn.Parameter(torch.empty(local, self.w2_weight.shape[1]), requires_grad=False)
        _set_loader(self.w2_bias, functools.partial(_w2_bias_loader, self.placement),
                    (self.num_experts, self.w2_weight.shape[1]))

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts as indices into this rank's weights, -1 where another rank holds
        the expert (a gather: no host sync, so CUDA graphs capture it)."""
        return topk_ids if self.expert_map is None else self.expert_map[topk_ids]

    def checkpoint_part(self, param_name: str, shard_id) -> tuple[torch.Tensor, int | None, int] | None:
        """This rank's part of one expert's checkpoint tensor (get_weights_by_name): (the part,
        the dim the ranks split it on (None: whole), where the part starts on it); None when the
        expert is another rank's."""
        e, j = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        here = self.placement.local(e)
        if here is None:
            return None
        start = self.i_rank * (self.intermediate_size // self.i_size)
        dim = None if self.i_size == 1 else (0 if j is not None else 1)
        if param_name.endswith("w13_weight"):
            part = self.w13_weight.shape[1] // 2
            return self.w13_weight[here].narrow(0, j * part, part), dim, start
        return self.w2_weight[here], dim, start

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        weights, ids = layers.select_experts(router_logits, self.top_k, self.renormalize, self.scoring)
        ids = self.local_ids(ids)
        # layers.fused_moe: the Triton kernels on the Triton path (sync-free: graphs capture them;
        # up to LOOM_MOE_GEMV_MAX_TOKENS tokens, a static count in a graph, the GEMV path: with the
        # router's GEMV and top-k, four launches per layer at decode),
        # the routed reference otherwise; that one reads which experts were chosen (a host
        # sync), so a CUDA-graph capture on the reference path runs the dense, sync-free one
        moe = layers.fused_moe
        if moe is fused_moe_ref and hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            moe = fused_moe_dense_ref
        # the down bias once per token's sum: on i_rank 0 (add_biases)
        out = moe(hidden, self.w13_weight, self.w2_weight, weights, ids, w13_bias=self.w13_bias,
                  w2_bias=self.w2_bias if self.i_rank == 0 else None, activation=self.activation)
        return all_reduce(out) if reduce else out


class Router(nn.Module):
    """The replicated gate: hidden [T, H] -> router logits [T, E] (HF's `gate.weight`)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = replicated(nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode batch: the GEMV kernel (cuBLAS's smallest GEMM costs more than reading E x H)
        if layers.use_gemv(x):
            return layers.gemv(x, self.weight)[0]
        return nn.functional.linear(x, self.weight)
