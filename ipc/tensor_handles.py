"""Tensors handed to the workers by another process on the same host, never pickled.

`update_weights_from_tensor` takes a list of handles, each plain JSON (msgspec Structs below):

    {"name": "model.layers.0.mlp.up_proj.weight", "dtype": "float32", "shape": [128, 64],
     "shm": {"segment": "loom-tensors-4242-9f2c", "offset": 0}}

  - CPU tensors live in a POSIX shared-memory segment (/dev/shm/<segment>), C-contiguous, at
    `offset` bytes; `share_tensors` packs several into one segment (offsets aligned to 64 bytes).
    The receiver maps the segment privately, copies each tensor into its parameter and unmaps;
    the sender unlinks the segment once the call has returned.
  - CUDA tensors travel as a CUDA IPC handle instead of "shm": `cuda_ipc` holds the fields of
    torch.multiprocessing.reductions.reduce_tensor (the storage's cudaIpcMemHandle and the
    ref-counter and event handles as hex, sizes, offsets, stride, device index). The sender
    keeps the tensors alive until the call returns; the receiver opens the handle, copies, and
    drops it.

dtype is a torch dtype name ("bfloat16", "float32"; "torch.bfloat16" is accepted too).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import re
import uuid
from typing import Iterable, Iterator

import msgspec
import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class ShmLocation(msgspec.Struct, forbid_unknown_fields=True):
    segment: str          # the name under /dev/shm
    offset: int = 0       # bytes from the start of the segment


class CudaIpcHandle(msgspec.Struct, forbid_unknown_fields=True):
    device: int
    storage_handle: str   # hex of the cudaIpcMemHandle
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int    # elements from the start of the storage
    stride: list[int]
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str
    event_sync_required: bool


class TensorHandle(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    shm: ShmLocation | None = None
    cuda_ipc: CudaIpcHandle | None = None


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its name ("bfloat16" or "torch.bfloat16"); ValueError otherwise."""
    short = name[6:] if name.startswith("torch.") else name
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- sender side

class SharedTensors:
    """Handles for named tensors (CPU ones copied into one shared-memory segment, CUDA ones
    shared in place). Close it (or use `with`) once the receiver is done: that unlinks the
    segment and releases the CUDA tensors."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        named = [(n, t.detach()) for n, t in named_tensors]
        self.handles: list[TensorHandle] = []
        self._keep: list[torch.Tensor] = []   # CUDA tensors whose IPC handles are out
        self.segment: str | None = None
        cpu = [(n, t) for n, t in named if t.device.type == "cpu"]
        if cpu:
            self._write_segment(cpu)
        for n, t in named:
            if t.device.type == "cuda":
                self.handles.append(TensorHandle(n, dtype_name(t.dtype), list(t.shape), cuda_ipc=_cuda_handle(t)))
                self._keep.append(t)
            elif t.device.type != "cpu":
                raise ValueError(f"tensor {n!r} is on {t.device}: only CPU and CUDA tensors can be shared")

    def _write_segment(self, named: list[tuple[str, torch.Tensor]]) -> None:
        offsets, size = [], 0
        for _, t in named:
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.segment = f"loom-tensors-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(os.path.join(SHM_DIR, self.segment), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            with mmap.mmap(fd, max(size, 1)) as mm:
                for (n, t), off in zip(named, offsets):
                    if t.numel():
                        torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape).copy_(t)
                    self.handles.append(TensorHandle(n, dtype_name(t.dtype), list(t.shape),
                                                     shm=ShmLocation(self.segment, off)))
        finally:
            os.close(fd)

    def to_builtins(self) -> list[dict]:
        """The handles as JSON-ready dicts (the body's "named_tensors")."""
        return msgspec.to_builtins(self.handles)

    def close(self) -> None:
        if self.segment is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.segment))
            self.segment = None
        self._keep = []

    def __enter__(self) -> "SharedTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cuda_handle(t: torch.Tensor) -> CudaIpcHandle:
    from torch.multiprocessing.reductions import reduce_tensor
    _, args = reduce_tensor(t)
    (_, _, stride, tensor_offset, _, _, device, storage_handle, storage_size, storage_offset, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return CudaIpcHandle(int(device), storage_handle.hex(), int(storage_size), int(storage_offset),
                         int(tensor_offset), list(stride), ref_counter_handle.hex(), int(ref_counter_offset),
                         event_handle.hex(), bool(event_sync_required))


# ---------------------------------------------------------------- receiver side

def decode_handles(raw: list) -> list[TensorHandle]:
    """Handles from JSON-like data; ValueError names what is malformed."""
    try:
        handles = msgspec.convert(raw, list[TensorHandle])
    except msgspec.ValidationError as e:
        raise ValueError(f"malformed tensor handles: {e}") from None
    for h in handles:
        if (h.shm is None) == (h.cuda_ipc is None):
            raise ValueError(f"tensor {h.name!r}: give exactly one of 'shm' and 'cuda_ipc'")
        if h.shm is not None and not _SEGMENT_NAME.match(h.shm.segment):
            raise ValueError(f"tensor {h.name!r}: bad shared-memory segment name {h.shm.segment!r}")
        if any(d < 0 for d in h.shape):
            raise ValueError(f"tensor {h.name!r}: negative size in shape {h.shape}")
    return handles


@contextlib.contextmanager
def open_tensors(handles: list[TensorHandle], device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The handles' tensors (views of the sender's memory, valid inside the `with`)."""
    maps: dict[str, mmap.mmap] = {}
    out: list[tuple[str, torch.Tensor]] = []
    try:
        for h in handles:
            dtype = parse_dtype(h.dtype)
            if h.shm is not None:
                mm = maps.get(h.shm.segment) or maps.setdefault(h.shm.segment, _map_segment(h.shm.segment))
                out.append((h.name, _shm_view(mm, h, dtype)))
            else:
                out.append((h.name, _open_cuda(h, dtype, device)))
        yield out
    finally:
        out.clear()   # the views must go before their mappings close
        for mm in maps.values():
            with contextlib.suppress(BufferError):  # a view still held elsewhere: closed when collected
                mm.close()


def _map_segment(segment: str) -> mmap.mmap:
    try:
        fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDONLY)
    except FileNotFoundError:
        raise ValueError(f"shared-memory segment {segment!r} does not exist") from None
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: nothing is written back
    finally:
        os.close(fd)


def _shm_view(mm: mmap.mmap, h: TensorHandle, dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for d in h.shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if h.shm.offset < 0 or h.shm.offset + nbytes > len(mm):
        raise ValueError(f"tensor {h.name!r}: {nbytes} bytes at offset {h.shm.offset} do not fit in "
                         f"segment {h.shm.segment!r} ({len(mm)} bytes)")
    if numel == 0:
        return torch.empty(h.shape, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=h.shm.offset).view(h.shape)


def _open_cuda(h: TensorHandle, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        raise ValueError(f"tensor {h.name!r} is a CUDA IPC handle, but the workers run on {device}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    c = h.cuda_ipc
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h.shape), tuple(c.stride), c.tensor_offset, torch.TypedStorage,
                               dtype, c.device, bytes.fromhex(c.storage_handle), c.storage_size_bytes,
                               c.storage_offset_bytes, False, bytes.fromhex(c.ref_counter_handle),
                               c.ref_counter_offset, bytes.fromhex(c.event_handle), c.event_sync_required)
