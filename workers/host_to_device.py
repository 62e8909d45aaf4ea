"""One step's host arrays to the device in one transfer per dtype, from pinned memory.

The arrays travel in typed structures (workers/step_inputs.StepArrays, the sampler's
SamplingArrays): dataclasses whose fields are numpy arrays on the host and torch
tensors on the device, with the same names. upload() turns one into the other. (Plain
dataclasses, not slots ones: copying one's instance dict is the cheapest way to build the
other, every step.)

A copy from pageable memory makes the host wait for the device's queue to
drain, which would undo the overlap of step N+1's preparation with step N.
Two pinned buffers alternate (Alternating, also the decode graphs' staging);
before one is rewritten, the event recorded after its last copy is awaited
(normally long done), so a copy still queued on the device never reads data of
a later step.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch

# A field of a step's structures: a numpy array on the host, a torch tensor on the device.
Array = TypeVar("Array", np.ndarray, torch.Tensor)
Struct = TypeVar("Struct")
_LEAF = (np.ndarray, torch.Tensor)


def pinned(host: torch.Tensor | list[torch.Tensor], device: torch.device,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor (a list: concatenated along dim 0), in `dtype` if given, ready for a
    non_blocking copy to `device`: gathered into pinned memory when it is a GPU, where a copy
    from pageable memory would wait for every step launched before it (the caching host
    allocator keeps the buffer until the copy is done); as it is elsewhere. Cast while gathered:
    fp32 pixels or audio features for a bf16 encoder are half the bytes to pin and to copy."""
    parts = host if isinstance(host, list) else [host]
    dtype = dtype or parts[0].dtype
    if device.type != "cuda":
        return (torch.cat(parts) if len(parts) > 1 else parts[0]).to(dtype)
    out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype, pin_memory=True)
    start = 0
    for p in parts:
        out[start:start + p.shape[0]].copy_(p)
        start += p.shape[0]
    return out


def to_device(host: torch.Tensor | list[torch.Tensor], device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor (a list: concatenated), in `dtype` if given, on `device`, copied from
    pinned memory without a stream sync (pinned)."""
    return pinned(host, device, dtype).to(device, non_blocking=True)


def _shell(struct: Struct, skip: frozenset[str], leaves: list) -> Struct:
    """A copy of a structure with its array fields None (nested structures copied alike), and,
    appended to `leaves`, (the copy's field dict, field name, array) for each array field not
    in `skip`. Copies the instance dict rather than calling __init__ with ~20 keyword
    arguments: a step pays for this, and it costs a few dict operations."""
    values = struct.__dict__.copy()
    for name, value in values.items():   # (values change, keys do not)
        if value is None:
            continue
        if name in skip:
            values[name] = None
        elif isinstance(value, _LEAF):
            values[name] = None
            leaves.append((values, name, value))
        else:  # a nested structure (StepArrays holds the sampler's SamplingArrays)
            values[name] = _shell(value, skip, leaves)
    out = object.__new__(type(struct))
    out.__dict__ = values
    return out


def map_arrays(struct: Struct, fn: Callable, skip: frozenset[str] = frozenset()) -> Struct:
    """The same structure with fn applied to each array field (nested structures too); None
    fields, and those named in `skip` (at any depth), become None."""
    leaves: list = []
    out = _shell(struct, skip, leaves)
    for values, name, value in leaves:
        values[name] = fn(value)
    return out


class Alternating:
    """Which of two pinned buffers a step writes: turn() picks the other one, once the copy
    queued from it last is done; copied() marks the end of this step's copies from it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.parity = 0
        self._copied: list = [None, None]  # per buffer: event after its last copy

    def turn(self) -> int:
        self.parity ^= 1
        if self._copied[self.parity] is not None:
            self._copied[self.parity].synchronize()  # long done: it was two steps ago
        return self.parity

    def copied(self) -> None:
        if self.cuda:
            self._copied[self.parity] = torch.cuda.Event()
            self._copied[self.parity].record()


class HostToDevice:
    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[tuple[np.dtype, int], torch.Tensor] = {}
        self._turns = Alternating(device)

    def upload(self, host: Struct, skip: frozenset[str] = frozenset()) -> Struct:
        """A structure of host arrays as the same structure of device tensors (the fields named
        in `skip` left None); no copy at all when nothing is left to upload."""
        leaves: list = []
        device = _shell(host, skip, leaves)
        for (values, name, _), tensor in zip(leaves, self([array for _, _, array in leaves])):
            values[name] = tensor
        return device

    def __call__(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays on the device, in their order."""
        if not self.pinned:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if not arrays:
            return []
        parity = self._turns.turn()
        out: list = [None] * len(arrays)
        for dtype in {a.dtype for a in arrays}:
            group = [(i, a) for i, a in enumerate(arrays) if a.dtype == dtype]
            # every array starts 16-byte aligned, as a fresh tensor would: kernels then see
            # the same pointer alignment every step (no Triton recompiles)
            align = max(1, 16 // dtype.itemsize)
            starts = np.cumsum([0] + [-(-a.size // align) * align for _, a in group])
            total = int(starts[-1])
            host = self._buffer(dtype, total, parity)
            flat = host.numpy()
            for (_, a), start in zip(group, starts):
                flat[start:start + a.size] = a.reshape(-1)
            dev = host[:total].to(self.device, non_blocking=True)
            for (i, a), start in zip(group, starts):
                out[i] = dev[start:start + a.size].view(a.shape)
        self._turns.copied()
        return out

    def _buffer(self, dtype: np.dtype, size: int, parity: int) -> torch.Tensor:
        key = (dtype, parity)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < size:
            torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
            buf = torch.empty(max(size, 1 << 16), dtype=torch_dtype, pin_memory=True)
            self._buffers[key] = buf
        return buf
