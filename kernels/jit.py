"""`triton.jit` for kernels called with per-step values, whether a kernel runs
(CUDA, or the CPU interpreter), the SM count launch grids are sized by, and
whether a decode kernel launches with programmatic dependent launch.

Triton compiles a variant of a kernel per "specialization": whether each int
argument is 1 or a multiple of 16, and whether each pointer is 16-byte
aligned. Per-step metadata (sequence counts, token offsets, slices of the
step's host-to-device buffer) would make a serving run compile new variants
mid-run, 0.1-1 s each. Arguments named here are never specialized; they are
all scalars or pointers read a few elements at a time, so nothing is lost.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from ipc import envs

_HAS_ALIGNMENT_FLAG = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def step_jit(*, ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()):
    """triton.jit that does not specialize on the given int values or pointer alignments."""
    kwargs = {"do_not_specialize": list(ints)}
    if _HAS_ALIGNMENT_FLAG:
        kwargs["do_not_specialize_on_alignment"] = list(pointers)
    else:  # older Triton: do_not_specialize also drops a pointer's alignment check
        kwargs["do_not_specialize"] += list(pointers)
    return triton.jit(**kwargs)


def is_interpreted(kernel) -> bool:
    """Whether a kernel was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def runs_triton(kernel, t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors when the kernel is interpreted;
    otherwise the caller falls back to its torch reference."""
    return t.is_cuda or is_interpreted(kernel)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: read every step); 4 elsewhere."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while
# the kernel before it still runs. Each of ours reads only constant data (weights) before
# gdc_wait, which returns once its predecessor has completed and its writes are visible; then it
# lets its own successor launch (gdc_launch_dependents). So every memory effect keeps the
# stream's order, while a decode-sized kernel's launch and first weight loads overlap the kernel
# before it: a Qwen3-0.6B batch-1 decode graph 0.869 -> 0.812 ms (bench/RESULTS.md).
# LOOM_PDL=0 turns it off (A/B runs).
_PDL: dict[int, bool] = {}
_pdl_enabled: bool | None = None   # None: LOOM_PDL, read at the first launch


def _pdl_on() -> bool:
    global _pdl_enabled
    if _pdl_enabled is None:
        _pdl_enabled = envs.LOOM_PDL
    return _pdl_enabled


def set_pdl(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for later launches (and graph captures);
    returns the setting it replaces."""
    global _pdl_enabled
    before, _pdl_enabled = _pdl_on(), enabled
    return before


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device launches with programmatic dependent launch."""
    if not (_pdl_on() and t.is_cuda):
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _PDL:
        _PDL[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL[idx]


def pdl_args(t: torch.Tensor) -> dict:
    """A PDL kernel's launch arguments: its PDL constexpr and Triton's launch_pdl, always equal."""
    pdl = use_pdl(t)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """In a kernel launched with pdl_args, after its loads of constant data: wait for the kernel
    before to complete, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
