"""The LoRA side of a base linear: its adapters' stacked A and B in the GPU slots, and the delta
its forward adds (kernels/lora.py), for each row the adapter of that row's slot.

A LoRALinear hangs on a ColumnParallelLinear or RowParallelLinear as `linear.lora` (set by
workers/lora/manager.py when the engine runs with --enable-lora); the linear's forward calls it
while the step has adapter rows (`LoRAContext.active`). Its buffers, allocated at start for
--max-loras slots of rank --max-lora-rank:

    a [max_loras, n_slices * R, in]   each slice's A in R rows (an adapter of rank r < R: zeros after r)
    b [max_loras, out, R]             each slice's B rows, scaled (scale * B)

Tensor parallelism shards them as the base weight is sharded: a column-parallel layer keeps every
A whole and the rank's output rows of each slice's B; a row-parallel layer keeps the rank's input
columns of A and all of B, and each rank adds its partial delta before the all-reduce sums the
ranks' products (the delta is linear in the rank's x and A columns, so the sum is the whole delta).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ipc import envs
from kernels.lora import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref
from workers.distributed import linear_all_reduce
from workers.lora.peft import LoRAModuleWeights
from workers.models import layers


class LoRAContext:
    """The step's adapter index per token, one device buffer read by every LoRALinear (and by the
    CUDA graphs, which captured its address): token t runs the adapter in slot token_slots[t], -1
    the base model. Past the step's tokens it always holds -1 (the padded rows of a graph).
    `active`: whether the step has any adapter row; the eager path skips LoRA entirely without."""

    def __init__(self, max_tokens: int, device: torch.device, use_triton: bool):
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.active = True   # warm-up and graph capture record the LoRA ops
        # the runner's kernel choice (--attention-backend): Triton, or the torch references
        # (the Triton shrink splits K at decode sizes: its partials go to the expand as they are)
        # (from LOOM_LORA_SORTED_ROWS rows to 256, the rows in adapter order: sorted_rows=None)
        self.shrink = (functools.partial(lora_shrink, splits=None, sorted_rows=None) if use_triton
                       else lora_shrink_ref)
        self.expand = functools.partial(lora_expand, sorted_rows=None) if use_triton else lora_expand_ref

    def slots(self, rows: int) -> torch.Tensor:
        return self.token_slots[:rows]


class LoRALinear:
    """The LoRA buffers and delta of one base linear.

    slices: each slice's (checkpoint module name, this rank's output rows: start in the full
    slice, size, offset in this rank's output) for a column-parallel layer; a row-parallel layer
    has one slice, and `in_shard` (start, size) of the input columns this rank holds."""

    def __init__(self, ctx: LoRAContext, in_features: int, out_features: int, slices: list[tuple[str, int, int, int]],
                 full_out: list[int], max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 in_shard: tuple[int, int] | None = None, full_in: int | None = None):
        self.ctx = ctx
        self.slices = slices
        self.full_out = full_out          # each slice's output rows at TP=1
        self.full_in = full_in or in_features
        self.in_shard = in_shard          # row-parallel: (start, size) of this rank's input columns
        self.rank = max_rank
        self.a = torch.zeros((max_loras, len(slices) * max_rank, in_features), dtype=dtype, device=device)
        self.b = torch.zeros((max_loras, out_features, max_rank), dtype=dtype, device=device)
        self.slice_starts = tuple(offset for _, _, _, offset in slices)

    @property
    def module_names(self) -> list[str]:
        return [name for name, *_ in self.slices]

    @property
    def active(self) -> bool:
        return self.ctx.active

    def epilogue(self, x: torch.Tensor):
        """The shrink of x, and what the decode GEMV's epilogue needs to add the delta
        (kernels/gemv.py LoRAEpilogue; it runs the expand itself where it does not fuse it)."""
        from kernels.gemv import LoRAEpilogue
        slots = self.ctx.slots(x.shape[0])
        return LoRAEpilogue(self.ctx.shrink(x, self.a, slots), self.b, slots, self.slice_starts)

    def fused_shrink(self, linear, x: torch.Tensor) -> bool:
        """Whether the batch-1 shrink runs in the kernel of the norm or SiLU before the linear
        (kernels/gemv.py lora_shrink_prologue, LOOM_LORA_FUSED_SHRINK): one row through the decode
        GEMV, an unquantized weight."""
        return (envs.LOOM_LORA_FUSED_SHRINK and x.dim() == 2 and x.shape[0] == 1 and layers.use_gemv(x)
                and linear.quant_method is None)

    def shrink_prologue(self, x: torch.Tensor, prologue: str, residual: torch.Tensor | None = None,
                        norm=None):
        """The batch-1 shrink with the linear's input built in the same kernel: (the input, the new
        residual or None, the GEMV's LoRAEpilogue)."""
        from kernels.gemv import LoRAEpilogue, lora_shrink_prologue
        slots = self.ctx.slots(1)
        kw = dict(residual=residual, norm_weight=norm.weight, eps=norm.eps) if norm is not None else {}
        xa, x_in, new_residual = lora_shrink_prologue(x, self.a, slots, prologue, **kw)
        return x_in, new_residual, LoRAEpilogue(xa, self.b, slots, self.slice_starts)

    def normed_forward(self, linear, x: torch.Tensor, residual: torch.Tensor | None, norm):
        """A column-parallel linear's forward_normed at one row: the norm and the shrink in one kernel,
        then the GEMV with the expand in its epilogue (the base linear's two kernels: the norm's,
        then its GEMV). Returns (y, the new residual)."""
        prologue = "rms_norm" if residual is None else "add_rms_norm"
        normed, new_residual, epilogue = self.shrink_prologue(x, prologue, residual, norm)
        y = layers.gemv(normed, linear.weight, linear.bias, lora=epilogue)[0]
        return y, (x if residual is None else new_residual)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this linear's output for x [T, in], [T, out]) plus each row's adapter delta, in place."""
        slots = self.ctx.slots(x.shape[0])
        xa = self.ctx.shrink(x, self.a, slots)
        return self.ctx.expand(y, xa, self.b, slots, self.slice_starts)

    # ---------------------------------------------------------------- the slots

    def check(self, modules: dict[str, LoRAModuleWeights], path: str) -> None:
        """Raise LoRAAdapterError unless each slice's pair fits (full shapes, rank)."""
        from workers.lora.peft import LoRAAdapterError
        for (name, *_), full_out in zip(self.slices, self.full_out):
            m = modules.get(name)
            if m is None:
                continue
            if m.rank > self.rank:
                raise LoRAAdapterError(f"{path}: {name} has rank {m.rank} > --max-lora-rank {self.rank}")
            if tuple(m.a.shape) != (m.rank, self.full_in) or tuple(m.b.shape) != (full_out, m.rank):
                raise LoRAAdapterError(
                    f"{path}: {name}: lora_A {tuple(m.a.shape)} / lora_B {tuple(m.b.shape)} do not fit the model's "
                    f"layer ([r, {self.full_in}] and [{full_out}, r])")

    @torch.no_grad()
    def set_slot(self, slot: int, modules: dict[str, LoRAModuleWeights]) -> None:
        """Write an adapter's pairs for this linear into `slot` (zeros for slices it does not train)."""
        a, b, r_max = self.a[slot], self.b[slot], self.rank
        a.zero_()
        b.zero_()
        for j, (name, start, size, offset) in enumerate(self.slices):
            m = modules.get(name)
            if m is None:
                continue
            r = m.rank
            ma = m.a if self.in_shard is None else m.a.narrow(1, *self.in_shard)
            a[j * r_max:j * r_max + r].copy_(ma)
            # the scale in float32, then one rounding to the buffers' dtype
            b[offset:offset + size, :r].copy_(m.b.narrow(0, start, size).float() * m.scale)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    # ---------------------------------------------------------------- the forwards with LoRA

    def row_forward(self, linear, x: torch.Tensor, silu_mul: bool):
        """A row-parallel linear's forward with the delta: the activation first (not fused into
        the GEMV: the delta needs its output too; at batch 1 fused with the shrink), then the
        product and this rank's delta, then the sum over the ranks."""
        epilogue = None
        if silu_mul and self.fused_shrink(linear, x):   # batch 1: the SiLU and the shrink in one kernel
            x, _, epilogue = self.shrink_prologue(x, "silu_mul")
        elif silu_mul:
            x = layers.silu_and_mul(x)

        def matmul(x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            if layers.use_gemv(x2):
                lora = epilogue if epilogue is not None else self.epilogue(x2)
                return layers.gemv(x2, weight, out=out, lora=lora)[0]
            if out is None:
                y = F.linear(x2, weight)
            else:
                y = torch.mm(x2, weight.t(), out=out)
            return self.add(x2, y)

        if linear.tp == 1:
            y = matmul(x, linear.weight)
        else:
            y = linear_all_reduce(x, linear.weight, matmul, norm_slot=linear.norm_slot)
        return y if linear.bias is None else y + linear.bias
