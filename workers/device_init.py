"""The worker's CUDA context, created in a thread while the worker still imports.

Creating the context (driver init, the primary context on an H200's 141 GB) takes a second or
more, and nothing before the model's first allocation needs it. The thread starts before torch is
imported: it initializes the driver and retains the device's primary context through libcuda
itself (ctypes releases the GIL for the call), so that this runs while the main thread imports
torch (2-4 s); then it imports torch (waiting for the main thread's import) and lets torch make
its runtime state on that context. The main thread meanwhile imports Triton, the kernels, the
model runner and transformers' config classes. The model runner waits for it (`wait`) before it
sets its device; a failure here is left for that path to report with its own message.
"""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

_thread: threading.Thread | None = None


def start(device: str, local_rank: int) -> None:
    """Start creating cuda:local_rank's context, for a worker whose --device is auto or cuda;
    nothing for a CPU worker. Imports nothing in the calling thread."""
    global _thread
    if device not in ("auto", "cuda") or _thread is not None:
        return

    def create() -> None:
        try:
            _driver_context(local_rank)
            import torch
            if device == "auto" and not torch.cuda.is_available():
                return
            torch.cuda.set_device(local_rank)   # (this thread's current device only)
            torch.empty(1, device=f"cuda:{local_rank}")
        except Exception as e:   # the main thread meets it again and reports it
            logger.debug("early CUDA init of cuda:%d failed: %s", local_rank, e)

    _thread = threading.Thread(target=create, name="loom-cuda-init", daemon=True)
    _thread.start()


def _driver_context(ordinal: int) -> bool:
    """cuInit and the device's primary context, retained (torch's runtime then finds it made);
    False where there is no libcuda or no such device (torch then does it all, or reports why)."""
    import ctypes
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    return (cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
            and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0)


def wait() -> None:
    """Until the context started by `start` exists (at once when none was started). While it is
    still being created, import what the next phase needs first: transformers' config classes
    (1-2 s of imports, which the context's creation no longer serializes with)."""
    if _thread is None:
        return
    if _thread.is_alive():
        from transformers import AutoConfig, PretrainedConfig  # noqa: F401 - workers/hf_config.py's, now
    _thread.join()
