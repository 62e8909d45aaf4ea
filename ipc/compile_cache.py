"""Compile caches that survive restarts: Triton's compiled kernels (and its autotuning results)
under one Loom cache directory, kept across runs and keyed by the versions that make a compiled
kernel reusable. Triton keys each entry by the kernel's source, its specialization and the GPU
target itself; the directory adds Triton's and torch's versions, so that an upgrade starts a
fresh directory instead of mixing with (and growing) the old one. On a machine that has started a
model once, a restart compiles nothing. TRITON_CACHE_DIR, when set, wins."""
from __future__ import annotations

import os
from importlib import metadata

from ipc import envs


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def compile_cache_dir() -> str:
    """This run's Triton cache directory: $TRITON_CACHE_DIR, else LOOM_CACHE_ROOT/triton/<key>."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    key = f"triton-{_version('triton')}-torch-{_version('torch').replace('+', '-')}"
    return os.path.join(envs.LOOM_CACHE_ROOT, "triton", key)


def use_compile_cache() -> str:
    """Point Triton at compile_cache_dir() (made if missing) before this process compiles a kernel
    (Triton reads the variable as it compiles); returns the directory."""
    path = compile_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:   # a read-only home: Triton's own default then
        return path
    os.environ["TRITON_CACHE_DIR"] = path
    return path


def compiled_kernels() -> int | None:
    """Entries in this process's Triton cache directory (one per compiled kernel variant, and
    autotuning results): their growth over a phase is what it compiled. None without one."""
    path = os.environ.get("TRITON_CACHE_DIR")
    try:
        return len(os.listdir(path)) if path else None
    except OSError:
        return None
