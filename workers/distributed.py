"""Tensor-parallel state of one worker process, and the collectives the sharded layers call.

Every worker is one rank of one `torch.distributed` group: NCCL on CUDA, gloo on CPU (so CI
runs tensor parallelism for real on CPU processes). The engine core owns the rendezvous: it
serves a TCPStore (a free port on 127.0.0.1 for one node; --master-addr/--master-port across
nodes) and every rank connects to it.

The layers ask `tp_rank()` / `tp_size()` when they are built (1 and 0 when the process is not
a rank of a group, e.g. a model built by a test), and call `all_reduce` / `all_gather`.

All-reduce on CUDA: below `ONE_SHOT_MAX_BYTES` a one-shot all-reduce over peer-to-peer
memory (torch symmetric memory: each rank reads every peer's buffer over NVLink and sums,
one kernel, no ring) which beats NCCL for decode-sized tensors (8.4 us vs ~25 us eager at
64 KB on 2xH200); NCCL above it and wherever symmetric memory is unavailable. Both are
capturable in CUDA graphs. NVLink multicast is never used (no multimem ops).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = int(os.environ.get("LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES", 512 << 10))
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Rendezvous:
    """Where the ranks meet: the engine core's TCPStore."""
    host: str
    port: int
    world_size: int


@dataclass
class TPState:
    rank: int = 0
    size: int = 1
    group: object = None
    one_shot: "OneShotAllReduce | None" = None


_state = TPState()


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def serve_rendezvous(host: str, port: int, timeout_s: float = 900.0):
    """The engine core's side: a TCPStore the ranks connect to (port 0: a free one, bound here,
    so no other process can take it between picking and binding). Keep the object alive."""
    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_distributed(rank: int, rdv: Rendezvous, device: torch.device, dtype: torch.dtype,
                     timeout_s: float = 900.0) -> None:
    """Join the group as `rank` (NCCL on CUDA, gloo on CPU); dtype: that of the activations."""
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
        one_shot = OneShotAllReduce.create(_state.group, device, dtype)
        # every rank must take the same path for every all-reduce, or they would never pair up
        agreed = torch.tensor([1 if one_shot is not None else 0], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=_state.group)
        _state.one_shot = one_shot if agreed.item() else None
    logger.info("rank %d of %d joined the %s group", rank, rdv.world_size, backend)


def destroy_distributed() -> None:
    global _state
    if _state.size > 1 and dist.is_initialized():
        _state.one_shot = None
        dist.destroy_process_group()
    _state = TPState()


def describe() -> dict:
    one_shot = _state.one_shot
    return {"rank": _state.rank, "size": _state.size,
            "backend": dist.get_backend(_state.group) if _state.group is not None else None,
            "one_shot": one_shot is not None, "one_shot_max_bytes": one_shot.max_bytes if one_shot else 0}


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place (x is returned)."""
    if _state.size == 1:
        return x
    if _state.one_shot is not None and _state.one_shot.fits(x):
        return _state.one_shot(x)
    dist.all_reduce(x, group=_state.group)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """[N, k] on every rank -> [N, k * size], the ranks' pieces side by side in rank order."""
    if _state.size == 1:
        return x
    x = x.contiguous()
    n = _state.size
    if x.is_cuda:
        out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=_state.group)
        parts = out.unbind(0)
    else:
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=_state.group)
    return torch.cat(parts, dim=-1)


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The largest of each value over the ranks (decisions every rank must take alike)."""
    if _state.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_state.group)
    return t.tolist()


class OneShotAllReduce:
    """Sum over the ranks through torch symmetric memory: x is copied into this rank's
    symmetric buffer (of the model's dtype), then one kernel reads every peer's buffer over NVLink and writes the
    sum back into x. One buffer serves every call (the op's barriers order reuse)."""

    def __init__(self, buffer: torch.Tensor, group_name: str):
        self.buffer, self.group_name = buffer, group_name
        self.max_bytes = buffer.numel() * buffer.element_size()

    @classmethod
    def create(cls, group, device: torch.device, dtype: torch.dtype) -> "OneShotAllReduce | None":
        if ONE_SHOT_MAX_BYTES <= 0 or os.environ.get("LOOM_DISABLE_ONE_SHOT_ALLREDUCE") == "1":
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem
            if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
                return None
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8, a no-op after
                symm_mem.enable_symm_mem_for_group(group.group_name)
            numel = ONE_SHOT_MAX_BYTES // torch.empty(0, dtype=dtype).element_size()
            buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buffer, group.group_name)
            if handle is None:
                return None
            op = cls(buffer, group.group_name)
            # a real call now, so that a platform that cannot run it fails here, not mid-serving
            probe = torch.full((256,), float(dist.get_rank(group) + 1), dtype=dtype, device=device)
            op(probe)
            torch.cuda.synchronize(device)
            expect = dist.get_world_size(group) * (dist.get_world_size(group) + 1) / 2
            if not bool((probe == expect).all()):
                raise RuntimeError(f"one-shot all-reduce gave {probe[0].item()}, expected {expect}")
            return op
        except Exception as e:  # no P2P, no NVLink, an old torch: NCCL does everything
            logger.warning("one-shot all-reduce unavailable (%s: %s); using NCCL for every all-reduce",
                           type(e).__name__, e)
            return None

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype == self.buffer.dtype and x.is_contiguous() and nbytes <= self.max_bytes \
            and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        slot = self.buffer[:flat.numel()]  # offset 0 of the symmetric allocation
        slot.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", self.group_name, flat)
        return x
