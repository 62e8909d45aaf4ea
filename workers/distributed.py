"""Tensor-parallel state of one worker process, and the collectives the sharded layers call.

Every worker is one rank of one `torch.distributed` group: NCCL on CUDA, gloo on CPU (so CI
runs tensor parallelism for real on CPU processes). The engine core owns the rendezvous: it
serves a TCPStore (a free port on 127.0.0.1 for one node; --master-addr/--master-port across
nodes) and every rank connects to it.

The layers ask `tp_rank()` / `tp_size()` when they are built (1 and 0 when the process is not
a rank of a group, e.g. a model built by a test), and call `linear_all_reduce`,
`all_reduce_written` (the embedding) and `lm_head_logits`. With --enable-expert-parallel the
MoE layers ask `ep_rank()` / `ep_size()` instead: the tensor-parallel ranks are reused as
expert-parallel ones (vLLM's EP within one replica), so attention stays sharded by heads while
whole experts are placed on ranks, and the same group's all-reduce sums their partial outputs.

All-reduce on CUDA, by size (bf16, 2xH200, CUDA-graph replays: `python -m bench.allreduce_tp`):
- up to ONE_SHOT_MAX_BYTES (1 MiB) a one-shot all-reduce over peer-to-peer memory (torch
  symmetric memory: each rank reads every peer's buffer over NVLink and sums, one kernel):
  9.2 us at 8 KiB (NCCL 9.3), 16.4 us at 1 MiB (NCCL 17.0); eager it beats NCCL's ~36 us launch;
- up to TWO_SHOT_MAX_BYTES (16 MiB) the two-shot kernel: 20.5 us at 2 MiB (NCCL 29.6), 29.2 at
  4 MiB (34.9), the all-reduces of large decode batches;
- NCCL above, and wherever symmetric memory is unavailable.
All are capturable in CUDA graphs. NVLink multicast is never used (no multimem ops).

A row-parallel linear whose sum goes straight into an RMSNorm (o_proj and down_proj, then
the next norm) can defer its sum (`linear_all_reduce(..., norm_slot=)` returns a
`PendingSum`): the norm then sums over the ranks, adds the residual and normalises in one
kernel (kernels/allreduce_norm.py), up to FUSED_NORM_MAX_BYTES (4 MiB: it also beats the
two-shot kernel and the norm after it on the 2-4 MiB sums of 256-row decode steps, Qwen3-8B
TP=2 offline 14,480 -> 14,888 tok/s).

The vocab-parallel lm_head of a small batch (each rank's logits up to GATHER_MAX_BYTES, 1 MiB:
8 rows of Llama-3.1-8B at TP=2) writes into symmetric memory too, and one kernel gathers the
ranks' parts (`lm_head_logits`, kernels/all_gather.py). A larger batch whose rows sample
plainly (greedy, temperature, min-p) is not gathered at all: each rank keeps its part (a
`LogitsShard`) and the sampler exchanges a few values per row (kernels/sampling.py,
`sample_sharded`), where NCCL would move every rank's logits (39 MB per rank for 256 rows of
Qwen3-8B) and the sampler then read the whole vocabulary on every rank. Other batches gather
through NCCL.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ipc import envs
from ipc.sockets import Rendezvous

logger = logging.getLogger(__name__)

# The limits named above are ipc/envs.py's variables, read when SymmMemAllReduce.create builds the
# buffers: ONE_SHOT_MAX_BYTES and TWO_SHOT_MAX_BYTES (LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES,
# LOOM_TWO_SHOT_ALLREDUCE_MAX_BYTES), FUSED_NORM_MAX_BYTES (LOOM_FUSED_ALLREDUCE_NORM_MAX_BYTES),
# GATHER_MAX_BYTES (LOOM_ONE_SHOT_GATHER_MAX_BYTES) and LAMPORT_MAX_ROWS (LOOM_LAMPORT_ALLREDUCE_MAX_ROWS:
# up to this many rows the fused all-reduce + norm pushes into the peers' inboxes without flags;
# 0: always the flagged pull).

# the sharded sampler's chunk exchange holds at most 64 chunks per row (kernels/sampling.py)
MAX_SHARDED_SAMPLING_RANKS = 16
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class TPState:
    rank: int = 0
    size: int = 1
    group: object = None
    symm: "SymmMemAllReduce | None" = None
    expert_parallel: bool = False   # --enable-expert-parallel: the MoE layers place whole experts on ranks


_state = TPState()


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def ep_rank() -> int:
    """This rank's place among the ranks that the experts are spread over (0 without EP)."""
    return _state.rank if _state.expert_parallel else 0


def ep_size() -> int:
    """Ranks the experts of a MoE layer are spread over: the tensor-parallel ranks with
    --enable-expert-parallel, else 1 (every rank holds every expert, a slice of each)."""
    return _state.size if _state.expert_parallel else 1


def set_expert_parallel(enabled: bool) -> None:
    """Whether the MoE layers built from now on place whole experts on ranks (init_distributed
    sets it from --enable-expert-parallel; a test switches it between models)."""
    _state.expert_parallel = enabled


def serve_rendezvous(host: str, port: int, timeout_s: float = 900.0, listener: socket.socket | None = None):
    """The engine core's side: a TCPStore the ranks connect to (port 0: a free one, bound here,
    so no other process can take it between picking and binding). Keep the object alive.
    listener: a socket already listening on (host, port) (ipc.sockets.bind_rendezvous), which the
    store takes over; ranks that connected before the store existed wait in its backlog."""
    fd = listener.detach() if listener is not None else None
    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=fd)


def init_distributed(rank: int, rdv: Rendezvous, device: torch.device, dtype: torch.dtype,
                     timeout_s: float = 900.0, expert_parallel: bool = False) -> None:
    """Join the group as `rank` (NCCL on CUDA, gloo on CPU); dtype: that of the activations."""
    set_expert_parallel(expert_parallel)
    if rdv.world_size == 1:
        return
    if rdv.host in _LOOPBACK:
        # gloo opens its own sockets on the interface the hostname resolves to; on one node
        # (or a loopback simulation of several) keep them on loopback.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore(rdv.host, rdv.port, None, False, timeout=timedelta(seconds=timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=rdv.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    _state.rank, _state.size, _state.group = rank, rdv.world_size, dist.group.WORLD
    if device.type == "cuda":
        symm = SymmMemAllReduce.create(_state.group, device, dtype)
        # every rank must take the same path for every all-reduce, or they would never pair up
        agreed = torch.tensor([int(symm is not None), int(symm is not None and symm.fused is not None)],
                              device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=_state.group)
        _state.symm = symm if agreed[0].item() else None
        if _state.symm is not None and not agreed[1].item():
            _state.symm.fused = None
    logger.info("rank %d of %d joined the %s group", rank, rdv.world_size, backend)


def destroy_distributed() -> None:
    global _state
    if _state.size > 1 and dist.is_initialized():
        _state.symm = None
        dist.destroy_process_group()
    _state = TPState()


def describe() -> dict:
    symm = _state.symm
    return {"rank": _state.rank, "size": _state.size, "expert_parallel": _state.expert_parallel,
            "backend": dist.get_backend(_state.group) if _state.group is not None else None,
            "one_shot": symm is not None, "one_shot_max_bytes": symm.one_shot_max if symm else 0,
            "two_shot_max_bytes": symm.two_shot_max if symm else 0,
            "fused_allreduce_norm": symm is not None and symm.fused is not None,
            "one_shot_gather_max_bytes": symm.fused.gather_local.numel() * symm.buffer.element_size()
            if symm is not None and symm.fused is not None else 0,
            "lamport_max_rows": symm.fused.lamport_rows if symm is not None and symm.fused is not None else 0}


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place (x is returned)."""
    if _state.size == 1:
        return x
    method = _state.symm.method(x.numel(), x.dtype) if _state.symm is not None and x.is_contiguous() else None
    if method is not None:
        return _state.symm(x, method)
    dist.all_reduce(x, group=_state.group)
    return x


def _mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return F.linear(x, weight)
    return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out=out)


@dataclass
class PendingSum:
    """A row-parallel product not yet summed over the ranks: every rank's [rows, cols] part
    sits in its symmetric buffer `slot`. The RMSNorm that consumes it (`add_rms_norm`) sums,
    adds the residual and normalises in one kernel."""
    rows: int
    cols: int
    slot: int

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum + residual) * weight, sum + residual), as fused_add_rms_norm."""
        normed, new_residual = _state.symm.reduce_add_rms_norm(self, residual.reshape(self.rows, self.cols),
                                                               weight, eps)
        return normed.view(residual.shape), new_residual.view(residual.shape)


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, matmul=_mm,
                      norm_slot: int | None = None) -> torch.Tensor | PendingSum:
    """x @ weight.T summed over the ranks (a row-parallel linear's product). Through symmetric
    memory the matmul writes straight into the shared buffer, so no copy precedes the sum.
    matmul(x, weight, out=None): the product (into `out` [rows, N] when given); the decode
    GEMV passes itself, with its fused prologue.

    norm_slot (0 or 1): an RMSNorm consumes the sum, so it may come back as a PendingSum for
    the norm to finish (kernels/allreduce_norm.py). Consecutive deferred sums must alternate
    slots (a decoder layer: o_proj 0, down_proj 1), which is what lets the fused kernel skip
    a closing barrier."""
    if _state.size == 1:
        return matmul(x, weight)
    symm = _state.symm
    shape = x.shape[:-1] + (weight.shape[0],)
    rows, cols = x.numel() // x.shape[-1], weight.shape[0]
    if x.dtype != weight.dtype:
        return all_reduce(matmul(x, weight))
    x2 = x.reshape(rows, x.shape[-1])
    if norm_slot is not None and symm is not None and symm.can_fuse_norm(rows, cols, x.dtype):
        matmul(x2, weight, out=symm.fused_buffer(norm_slot, rows * cols).view(rows, cols))
        return PendingSum(rows, cols, norm_slot)
    return all_reduce_written(lambda out=None: matmul(x2, weight, out=out), rows, cols, x).view(shape)


def all_reduce_written(write: Callable[..., torch.Tensor], rows: int, cols: int,
                       like: torch.Tensor) -> torch.Tensor:
    """The [rows, cols] sum over the ranks of what write() computes on each (in like's dtype).
    Through symmetric memory write(out=buffer) fills the shared buffer itself, so no copy
    precedes the sum (a row-parallel matmul, the vocab-parallel embedding's lookup); at sizes
    it does not take, write() and then an all-reduce."""
    symm = _state.symm
    method = symm.method(rows * cols, like.dtype) if symm is not None else None
    if method is None:
        return all_reduce(write())
    write(out=symm.buffer_for(rows * cols).view(rows, cols))
    out = torch.empty((rows, cols), dtype=like.dtype, device=like.device)
    symm.reduce_buffer(rows * cols, method, out.view(-1))
    return out


@dataclass
class LogitsShard:
    """This rank's columns of the logits: [N, part] for the token ids vocab_start.. of a
    vocabulary of vocab_size ids (the last rank's columns past it are padding), split over
    `world` ranks in rank order."""
    logits: torch.Tensor
    vocab_start: int
    vocab_size: int
    world: int

    def __getitem__(self, rows: slice) -> "LogitsShard":
        return LogitsShard(self.logits[rows], self.vocab_start, self.vocab_size, self.world)


def lm_head_logits(x: torch.Tensor, weight: torch.Tensor, vocab_start: int, n_out: int, plain: bool
                   ) -> torch.Tensor | LogitsShard:
    """x [N, H] @ weight.T, this rank's part of a vocab-parallel lm_head (size > 1): every rank's
    parts side by side, [N, n_out] (the vocabulary's padding dropped), on every rank; or, for
    rows that sample plainly (`plain`) too many to gather in one shot, this rank's LogitsShard
    (the sampler exchanges a few values per row instead)."""
    symm = _state.symm
    rows, part = x.shape[0], weight.shape[0]
    if symm is not None and x.dtype == weight.dtype and symm.can_gather(rows, part, x.dtype):
        torch.mm(x, weight.t(), out=symm.gather_buffer(rows * part).view(rows, part))
        return symm.gather(rows, part, n_out, x)
    if plain and _state.size <= MAX_SHARDED_SAMPLING_RANKS:
        return LogitsShard(F.linear(x, weight), vocab_start, n_out, _state.size)
    logits = all_gather(F.linear(x, weight))
    return logits[:, :n_out].contiguous() if logits.shape[1] != n_out else logits


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """[N, k] on every rank -> [N, k * size], the ranks' pieces side by side in rank order."""
    x = x.contiguous()
    n = _state.size
    if x.is_cuda:
        out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=_state.group)
        # [n, N, k] -> [N, n * k]: a view for one row (a batch-1 decode step), else one copy
        return out.movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])
    parts = [torch.empty_like(x) for _ in range(n)]  # gloo has no all_gather_into_tensor
    dist.all_gather(parts, x, group=_state.group)
    return torch.cat(parts, dim=-1)


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The largest of each value over the ranks (decisions every rank must take alike)."""
    if _state.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_state.group)
    return t.tolist()


class SymmMemAllReduce:
    """Sums over the ranks through torch symmetric memory (peer-to-peer reads and writes over
    NVLink, no NCCL ring) for the sizes where that beats NCCL:
    - one-shot up to `one_shot_max` bytes: every rank reads every peer's buffer and sums
      (one kernel; latency-bound decode sizes);
    - two-shot up to `two_shot_max`: each rank sums its 1/W slice from all peers and writes it
      back to them (a reduce-scatter and an all-gather in one kernel; it moves 2/W of the data
      per rank instead of (W-1)/W x W, for the batch-sized all-reduces of large decode steps).
    One symmetric buffer serves every call: the ops' barriers order its reuse. A row-parallel
    matmul can write its product straight into it (`buffer_for`), which saves the copy.

    With `fused`, two more buffers of FUSED_NORM_MAX_BYTES (the slots of deferred sums), one of
    GATHER_MAX_BYTES and a flag per (program, rank) serve our own flag-synchronised kernels: the
    fused all-reduce + add + RMSNorm (kernels/allreduce_norm.py) and the logits' all-gather
    (kernels/all_gather.py). Two inboxes per rank (one per slot) serve the fused kernel's flagless
    Lamport variant, which sums deferred products of up to LAMPORT_MAX_ROWS rows."""

    def __init__(self, buffer: torch.Tensor, group_name: str, one_shot_max: int, two_shot_max: int):
        self.buffer, self.group_name = buffer, group_name
        self.one_shot_max, self.two_shot_max = one_shot_max, two_shot_max
        self.world_size = dist.get_world_size()
        self.fused: _FlaggedBuffers | None = None
        # programs of the fused all-reduce + norm, for A/B runs (None: one per SM; rows beyond loop in them)
        self.fused_programs = envs.LOOM_FUSED_ALLREDUCE_NORM_PROGRAMS or None

    @classmethod
    def create(cls, group, device: torch.device, dtype: torch.dtype) -> "SymmMemAllReduce | None":
        one_shot_max, two_shot_max = envs.LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES, envs.LOOM_TWO_SHOT_ALLREDUCE_MAX_BYTES
        if max(one_shot_max, two_shot_max) <= 0 or envs.LOOM_DISABLE_ONE_SHOT_ALLREDUCE:
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem
            if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
                return None
            two_shot_max = two_shot_max if hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out") else 0
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8, a no-op after
                symm_mem.enable_symm_mem_for_group(group.group_name)
            numel = max(one_shot_max, two_shot_max) // torch.empty(0, dtype=dtype).element_size()
            buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            if symm_mem.rendezvous(buffer, group.group_name) is None:
                return None
            op = cls(buffer, group.group_name, one_shot_max, two_shot_max)
            op._probe(device, dtype)
        except Exception as e:  # no P2P, no NVLink, an old torch: NCCL does everything
            logger.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL for every all-reduce",
                           type(e).__name__, e)
            return None
        fused_max = envs.LOOM_FUSED_ALLREDUCE_NORM_MAX_BYTES
        if envs.LOOM_FUSED_ALLREDUCE_NORM and fused_max > 0:  # 0: A/B runs
            try:
                op.fused = _FlaggedBuffers.create(group.group_name, device, dtype, fused_max,
                                                  max(envs.LOOM_ONE_SHOT_GATHER_MAX_BYTES, 0))
                op._probe_fused(device, dtype)
            except Exception as e:  # e.g. a Triton without system-scope atomics: the unfused pair, NCCL's gather
                logger.warning("fused all-reduce + RMSNorm and one-shot gather unavailable (%s: %s)",
                               type(e).__name__, e)
                op.fused = None
        return op

    def _probe(self, device: torch.device, dtype: torch.dtype) -> None:
        """A real call of each kernel now, so that a platform that cannot run one fails here,
        not mid-serving."""
        w = self.world_size
        expect = w * (w + 1) / 2
        calls = [(256, "one_shot")]
        if self.two_shot_max > self.one_shot_max:
            calls.append((self.two_shot_max // self.buffer.element_size(), "two_shot"))
        for numel, method in calls:
            probe = torch.full((numel,), float(dist.get_rank() + 1), dtype=dtype, device=device)
            self(probe, method)
            torch.cuda.synchronize(device)
            if not bool((probe == expect).all()):
                raise RuntimeError(f"symmetric-memory all-reduce of {numel} gave {probe[0].item()}, "
                                   f"expected {expect}")

    def _probe_fused(self, device: torch.device, dtype: torch.dtype) -> None:
        """One fused call per slot and one gather against the references, on data every rank
        can rebuild."""
        from kernels.all_gather import all_gather_ref
        from kernels.allreduce_norm import allreduce_add_rms_norm_ref
        rows, cols = 2, 256
        weight = torch.full((cols,), 0.5, dtype=dtype, device=device)
        for n in {1, self.fused.lamport_rows + 1}:  # the Lamport kernel (if on) and the pulled one
            parts = [((torch.arange(n * cols, device=device) % 7 - 3) * (r + 1) / 4).to(dtype).view(n, cols)
                     for r in range(self.world_size)]
            residual = torch.ones(n, cols, dtype=dtype, device=device)
            want = allreduce_add_rms_norm_ref(parts, residual, weight, 1e-6)
            for slot in (0, 1):
                self.fused_buffer(slot, n * cols).copy_(parts[dist.get_rank()].view(-1))
                got = self.reduce_add_rms_norm(PendingSum(n, cols, slot), residual, weight, 1e-6)
                torch.cuda.synchronize(device)
                if not (torch.equal(got[1], want[1]) and torch.allclose(got[0].float(), want[0].float(), 1e-2, 1e-2)):
                    raise RuntimeError(f"fused all-reduce + RMSNorm of {n} rows differs from its reference "
                                       f"(slot {slot})")
        part, n_out = 3000, 3000 * self.world_size - 5  # two programs per row, padding dropped
        if self.can_gather(rows, part, dtype):
            parts = [(torch.arange(rows * part, device=device) % 251 + 1000 * r).to(dtype).view(rows, part)
                     for r in range(self.world_size)]
            self.gather_buffer(rows * part).copy_(parts[dist.get_rank()].view(-1))
            got = self.gather(rows, part, n_out, parts[0])
            torch.cuda.synchronize(device)
            if not torch.equal(got, all_gather_ref(parts, n_out)):
                raise RuntimeError("one-shot all-gather differs from its reference")

    def can_fuse_norm(self, rows: int, cols: int, dtype: torch.dtype) -> bool:
        return (self.fused is not None and dtype == self.buffer.dtype and 0 < rows <= self.fused.max_rows
                and cols <= self.fused.max_cols and rows * cols * self.buffer.element_size() <= self.fused.max_bytes)

    def fused_buffer(self, slot: int, numel: int) -> torch.Tensor:
        return self.fused.local[slot][:numel]

    def can_gather(self, rows: int, cols: int, dtype: torch.dtype) -> bool:
        f = self.fused
        return (f is not None and dtype == self.buffer.dtype and rows > 0
                and rows * cols <= f.gather_local.numel() and f.gather_cells(rows, cols) <= f.max_rows)

    def gather_buffer(self, numel: int) -> torch.Tensor:
        return self.fused.gather_local[:numel]

    def gather(self, rows: int, cols: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
        """Every rank's gather_buffer [rows, cols] side by side -> a new [rows, n_out]."""
        f = self.fused
        return f.gather_kernel(f.gather_ptrs, f.flag_ptrs, f.rank, rows, cols, n_out, like)

    def reduce_add_rms_norm(self, pending: "PendingSum", residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.fused
        if pending.rows <= f.lamport_rows:
            part = f.local[pending.slot][:pending.rows * pending.cols].view(pending.rows, pending.cols)
            return f.lamport_kernel(part, f.inbox_ptrs[pending.slot], f.inbox_stride, f.rank, residual, weight, eps)
        return f.kernel(f.buf_ptrs[pending.slot], f.flag_ptrs, f.rank, pending.rows, residual, weight, eps,
                        programs=self.fused_programs)

    def method(self, numel: int, dtype: torch.dtype) -> str | None:
        """"one_shot", "two_shot", or None when a contiguous tensor of this size goes to NCCL."""
        nbytes = numel * self.buffer.element_size()
        if dtype != self.buffer.dtype or nbytes % 16:
            return None
        if nbytes <= self.one_shot_max:
            return "one_shot"
        if nbytes <= self.two_shot_max and nbytes % (16 * self.world_size) == 0:
            return "two_shot"
        return None

    def buffer_for(self, numel: int) -> torch.Tensor:
        return self.buffer[:numel]  # offset 0 of the symmetric allocation

    def reduce_buffer(self, numel: int, method: str, out: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's buffer_for(numel) into out (flat, numel elements)."""
        slot = self.buffer_for(numel)
        if method == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", self.group_name, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_out(slot, "sum", self.group_name, out)
        return out

    def __call__(self, x: torch.Tensor, method: str) -> torch.Tensor:
        """In place: x (contiguous) becomes the sum over the ranks."""
        flat = x.view(-1)
        self.buffer_for(flat.numel()).copy_(flat)
        self.reduce_buffer(flat.numel(), method, flat)
        return x


@dataclass
class _FlaggedBuffers:
    """The symmetric memory of our flag-synchronised kernels: the fused all-reduce + RMSNorm's
    two product buffers (slots) and Lamport inboxes, the logits gather's buffer, every rank's
    addresses of them as device tables, and the flags (int32 [max_rows, W] per rank, zero between calls, shared:
    a call takes one flag per program and peer, and every rank makes the same calls)."""
    local: tuple[torch.Tensor, torch.Tensor]  # this rank's slots (flat)
    buf_ptrs: tuple[torch.Tensor, torch.Tensor]  # per slot: int64 [W], every rank's slot address
    gather_local: torch.Tensor  # this rank's gather buffer (flat; empty: no one-shot gather)
    gather_ptrs: torch.Tensor | None  # int64 [W]: every rank's gather buffer (None: empty)
    flag_ptrs: torch.Tensor  # int64 [W]: every rank's flags
    inbox_ptrs: tuple[torch.Tensor, torch.Tensor]  # per slot: int64 [W], every rank's Lamport inbox
    inbox_stride: int  # elements between two senders' parts in an inbox
    lamport_rows: int  # the most rows the Lamport kernel takes (0: never)
    keep: tuple  # the symmetric allocations the tables point into
    rank: int
    max_rows: int  # of the fused norm, and the flags per peer
    max_cols: int
    max_bytes: int
    # the kernels, imported in create() (the engine core imports this module and needs no Triton):
    kernel: Callable  # kernels.allreduce_norm.allreduce_add_rms_norm
    gather_kernel: Callable  # kernels.all_gather.all_gather
    gather_cells: Callable  # kernels.all_gather.flag_cells: the flags per peer a gather takes
    lamport_kernel: Callable  # kernels.allreduce_norm.lamport_add_rms_norm

    @classmethod
    def create(cls, group_name: str, device: torch.device, dtype: torch.dtype, nbytes: int,
               gather_bytes: int) -> "_FlaggedBuffers":
        import torch.distributed._symmetric_memory as symm_mem

        from kernels.all_gather import all_gather as gather_kernel, flag_cells
        from kernels.allreduce_norm import INT_OF, MAX_COLS, allreduce_add_rms_norm, lamport_add_rms_norm, sentinel
        elem = torch.empty(0, dtype=dtype).element_size()
        numel, gather_numel = nbytes // elem, gather_bytes // elem // 16 * 16
        max_rows = max(1, nbytes // 256)  # rows of at least 128 elements
        world, rank = dist.get_world_size(), dist.get_rank()
        bufs = symm_mem.empty(2 * numel + gather_numel, dtype=dtype, device=device)
        flags = symm_mem.empty(max_rows * world, dtype=torch.int32, device=device)
        flags.zero_()
        lamport_rows = min(max(envs.LOOM_LAMPORT_ALLREDUCE_MAX_ROWS, 0), max_rows)
        inbox_stride = max(1, lamport_rows * MAX_COLS)
        inboxes = symm_mem.empty(2 * world * inbox_stride, dtype=INT_OF[elem], device=device)
        inboxes.fill_(sentinel(dtype))
        buf_handle = symm_mem.rendezvous(bufs, group_name)
        flag_handle = symm_mem.rendezvous(flags, group_name)
        inbox_handle = symm_mem.rendezvous(inboxes, group_name)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags are zero, and its inboxes empty, before any rank signals

        def table(handle, local: torch.Tensor, offset: int = 0) -> torch.Tensor:
            """Every rank's address of `local`, which starts `offset` elements into this rank's
            symmetric allocation."""
            ptrs = [handle.get_buffer(r, (local.numel(),), local.dtype, offset).data_ptr() for r in range(world)]
            if ptrs[rank] != local.data_ptr():
                raise RuntimeError("symmetric buffer addresses do not match this rank's tensor")
            return torch.tensor(ptrs, dtype=torch.int64, device=device)

        slots = (bufs[:numel], bufs[numel:2 * numel])
        gather = bufs[2 * numel:]
        half = world * inbox_stride
        return cls(local=slots, buf_ptrs=(table(buf_handle, slots[0]), table(buf_handle, slots[1], numel)),
                   gather_local=gather, gather_ptrs=table(buf_handle, gather, 2 * numel) if gather_numel else None,
                   flag_ptrs=table(flag_handle, flags),
                   inbox_ptrs=(table(inbox_handle, inboxes[:half]), table(inbox_handle, inboxes[half:], half)),
                   inbox_stride=inbox_stride, lamport_rows=lamport_rows,
                   keep=(bufs, flags, inboxes, buf_handle, flag_handle, inbox_handle), rank=rank,
                   max_rows=max_rows, max_cols=MAX_COLS, max_bytes=nbytes, kernel=allreduce_add_rms_norm,
                   gather_kernel=gather_kernel, gather_cells=flag_cells, lamport_kernel=lamport_add_rms_norm)
