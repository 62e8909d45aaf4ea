"""The worker's CUDA context, created in a thread while the worker still imports.

Creating the context (driver init, the primary context on an H200's 141 GB) takes a second or
more, and nothing before the model's first allocation needs it; without this it ran inside the
weights phase, after every import. torch.empty on the device releases the GIL while the context
is created, so the worker's remaining imports (Triton, the kernels, the model runner,
transformers for the config) run meanwhile. The model runner waits for it (`wait`) before it
sets its device; a failure here is left for that path to report with its own message.
"""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

_thread: threading.Thread | None = None


def start(device: str, local_rank: int) -> None:
    """Start creating cuda:local_rank's context, for a worker whose --device is auto or cuda;
    nothing for a CPU worker. Imports torch (the worker needs it next anyway)."""
    global _thread
    if device not in ("auto", "cuda") or _thread is not None:
        return
    import torch

    def create() -> None:
        try:
            if device == "auto" and not torch.cuda.is_available():
                return
            torch.cuda.set_device(local_rank)   # (this thread's current device only)
            torch.empty(1, device=f"cuda:{local_rank}")
        except Exception as e:   # the main thread meets it again and reports it
            logger.debug("early CUDA init of cuda:%d failed: %s", local_rank, e)

    _thread = threading.Thread(target=create, name="loom-cuda-init", daemon=True)
    _thread.start()


def wait() -> None:
    """Until the context started by `start` exists (at once when none was started). While it is
    still being created, import what the next phase needs first: transformers' config classes
    (1-2 s of imports, which the context's creation no longer serializes with)."""
    if _thread is None:
        return
    if _thread.is_alive():
        from transformers import AutoConfig, PretrainedConfig  # noqa: F401 - the model loader's, now
    _thread.join()
