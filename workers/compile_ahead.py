"""A start-up phase's Triton compiles in parallel: the phase runs once dry, then for real.

On a fresh machine the warm-up compiled ~60 kernel variants one after another (31 s on an H200):
each variant compiles when it is first launched, and the launch waits for it, so that the next
launch is not known until then. So the phase runs twice:

1. dry: every Triton launch becomes Triton's own `warmup` call, which launches nothing. A new
   variant's compile goes to a compile process (workers/compile_processes.py: the worker's GIL
   stays free for the dry pass) when its kernel can be imported there by name, else to a thread
   pool under `triton.AsyncCompileMode`. The torch ops between the launches still run, so every
   later launch sees the shapes, dtypes, int values and alignments it will see for real. What
   the kernels would have written stays as allocated, and
   every tensor allocated in the dry pass is zero-filled (a TorchDispatchMode): a value that
   comes out of a skipped kernel and indexes a torch op (a sampled token id, say) is a valid
   index, never the allocator's leftovers. The state allocated before (weights, KV cache, the
   sampler's tables) is not written by a skipped kernel; what torch ops write into it is what the
   phase's idle inputs make them write anyway (tests/test_compile_ahead.py runs the warm-up and
   the decode graphs dry on the CPU and checks the engine's tokens after). At its end the pass
   waits for every compile; then each variant compiled in a thread is made launchable in the
   pool (its launcher built, its binary loaded: what its first launch would do, one by one).
2. for real: every launch finds its variant compiled (in memory, or in Triton's cache dir with
   its launcher: a process's).

The worker runs its profiling run this way, and its warm-up together with the graph capture's
eager steps (workers/warmup.py: one pool, one wait). A start already completed on the same
compile cache (note_start) runs no dry runs: every kernel loads from the cache anyway.

A variant the dry pass did not reach (a host branch on a value the dry pass zeroed) compiles in
the real pass as before: the dry pass can only save time. LOOM_COMPILE_THREADS=0 runs the phase
once (the A/B switch of bench/startup.py); a Triton without AsyncCompileMode, or the CPU, too;
under tensor parallelism it is on only when LOOM_COMPILE_THREADS is set (its peer kernels: flags
and Lamport buffers, skipped on every rank, are untested that way).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ipc import envs
from workers.compile_processes import CompileJob, CompileProcesses

logger = logging.getLogger(__name__)
T = TypeVar("T")

_ALLOCATIONS = ("empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
                "new_empty_strided.default")


# Fields of the engine config that change which kernel variants a start compiles
_KEY_FIELDS = ("model", "dtype", "kv_cache_dtype", "block_size", "max_model_len", "max_num_seqs",
               "max_num_batched_tokens", "tensor_parallel_size", "quantization", "enforce_eager", "cuda_graph_sizes",
               "speculative_config", "enable_lora", "max_lora_rank", "max_loras", "attention_backend", "model_impl",
               "runner", "convert", "language_model_only", "hf_overrides", "enable_expert_parallel",
               "mm_encoder_budget", "mm_max_item_tokens", "calculate_kv_scales", "load_format")
# LOOM_* variables that do not change a kernel (the others, such as LOOM_GEMV or LOOM_PDL, do)
_KEY_IGNORES = {"LOOM_LOG_LEVEL", "LOOM_ENGINE_AUTH_KEY", "LOOM_RUN_ID", "LOOM_SERVE_PID", "LOOM_CACHE_ROOT",
                "LOOM_PROFILE_DIR", "LOOM_TORCH_PROFILER_DIR", "LOOM_STEP_STATS", "LOOM_COMPILE_THREADS"}
_marker: str | None = None    # this start's file under the compile cache (note_start)
_known_start = False          # the same start completed on this cache before: no dry runs
_processes: CompileProcesses | None = None   # the dry runs' compile processes (note_start to mark_started)
_SHIPPED = object()           # a variant's placeholder in its kernel cache while a process compiles it


def start_key(config, device_name: str) -> str:
    """What decides the kernel variants a worker's start compiles: the engine config's fields
    that shape them, the checkpoint's config.json, the GPU, the kernel-changing LOOM_* variables,
    and Loom's kernels and worker sources (their sizes and times). Triton's and torch's versions
    key the cache directory the marker lives in."""
    h = hashlib.sha256()
    fields = config.to_dict()
    h.update(json.dumps({k: fields.get(k) for k in _KEY_FIELDS}, sort_keys=True, default=str).encode())
    try:
        with open(os.path.join(str(config.model), "config.json"), "rb") as f:
            h.update(f.read())
    except OSError:
        pass
    h.update(device_name.encode())
    h.update(repr([(n, envs.read(n)) for n in sorted(envs.ENVIRONMENT_VARIABLES) if n not in _KEY_IGNORES]).encode())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("kernels", "workers"):
        for folder, _, files in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(files):
                if name.endswith(".py"):
                    st = os.stat(os.path.join(folder, name))
                    h.update(f"{os.path.relpath(folder, root)}/{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def note_start(config, device: torch.device) -> None:
    """Before a worker's first phase: whether this same start (start_key) completed on this
    compile cache before. Then every kernel loads from the cache and a dry run would only repeat
    its phase's host work (0.5-1 s each), so none runs; else the dry runs' compile processes
    start now."""
    global _marker, _known_start
    if device.type != "cuda":
        return
    from ipc.compile_cache import compile_cache_dir
    name = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    _marker = os.path.join(compile_cache_dir(), "loom-starts", start_key(config, name))
    _known_start = os.path.exists(_marker)
    _start_processes(device, config.data_parallel_size)


def _start_processes(device: torch.device, engines: int) -> None:
    """The compile processes of this start's dry runs, started now so that their imports overlap
    the worker's own start (none for a known start, or where no dry run runs): as many as its
    compile threads, the CPU's cores shared among the data-parallel engines' workers (each child
    holds its own torch: a few hundred MB)."""
    global _processes
    n = threads(device)
    if not envs.LOOM_COMPILE_THREADS:
        n = min(n, max(1, _cores() // engines))
    if n == 0 or _processes is not None:
        return
    try:
        from triton.runtime import driver
        _processes = CompileProcesses.start(n, dict(vars(driver.active.get_current_target())))
    except Exception as e:   # noqa: BLE001 - the dry runs then compile in threads only
        logger.warning("no compile processes (%s: %s): the start-up compiles in threads", type(e).__name__, e)


def _stop_processes() -> None:
    global _processes
    if _processes is not None:
        _processes.close()
        _processes = None


def mark_started() -> None:
    """After a worker's last phase (graph capture): this process's later phases (a wake-up) and
    later starts of the same key (note_start) run no dry runs; and from now on every Triton
    variant that still compiles (or loads from the disk cache) is logged (watch_mid_run_compiles)."""
    global _known_start
    _stop_processes()
    watch_mid_run_compiles()
    if _marker is None:   # (not a CUDA worker: nothing runs dry)
        return
    _known_start = True
    try:
        os.makedirs(os.path.dirname(_marker), exist_ok=True)
        with open(_marker, "w"):
            pass
    except OSError:   # a read-only cache: later starts dry-run again, nothing worse
        pass


class MidRunCompiles:
    """Triton's hooks around a variant's compile, installed once the worker serves: each variant
    the warm-up and graph capture did not reach stalls the step that first launches it (a
    compile: 0.1-1 s; a load from the disk cache: a few ms), so each is logged as a warning with
    its specialization, for the warm-up to cover it (bench runs grep "compiled mid-run")."""

    def __init__(self):
        self.started: dict[object, float] = {}
        self.count = 0

    def before(self, *, key, **_) -> bool:
        self.started[key] = time.perf_counter()
        return False   # (True would skip the compile)

    def after(self, *, key, repr, **kwargs) -> None:
        # the kernel's name and what picked this variant: its constexprs and the arguments'
        # specializations (alignment, divisibility), which the warm-up must cover
        ms = 1e3 * (time.perf_counter() - self.started.pop(key, time.perf_counter()))
        self.count += 1
        logger.warning("Triton compiled a kernel variant mid-run (%.0f ms, #%d): %s %.3000s", ms, self.count,
                       repr.split("(")[0], kwargs.get("compile") or key)


_mid_run: MidRunCompiles | None = None


def mid_run_compiles() -> int:
    """The Triton variants compiled (or loaded from the disk cache) since the worker served."""
    return 0 if _mid_run is None else _mid_run.count


def watch_mid_run_compiles() -> None:
    """Install MidRunCompiles on CUDA (once per process; the dry runs' own hook is gone by now)."""
    global _mid_run
    if _marker is None or _mid_run is not None:
        return
    try:
        from triton import knobs
        runtime = knobs.runtime
    except (ImportError, AttributeError):   # (a Triton without knobs: no watch)
        return
    _mid_run = MidRunCompiles()
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = _mid_run.before, _mid_run.after


def threads(device: torch.device) -> int:
    """Compile threads (and processes) for a phase on this device: LOOM_COMPILE_THREADS (unset:
    one per CPU core, at most 16, and none under tensor parallelism) on CUDA with a Triton that
    has AsyncCompileMode, else 0 (the phase runs once, compiling as it launches); 0 too once this
    start is known (note_start)."""
    if _known_start:
        return 0
    n = envs.LOOM_COMPILE_THREADS
    if n is None:
        from workers.distributed import tp_size
        if tp_size() > 1:   # not by default under tensor parallelism: its peer kernels (flags, Lamport
            return 0        # buffers) are untested skipped; LOOM_COMPILE_THREADS=N turns it on
        n = min(16, _cores())
    if n <= 0 or device.type != "cuda":
        return 0
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    if getattr(triton, "AsyncCompileMode", None) is None or not hasattr(JITFunction, "run"):
        return 0
    return n


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ZeroedAllocations(TorchDispatchMode):
    """Every tensor allocated uninitialized under it is zero-filled (on `devices`' types)."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        super().__init__()
        self.devices = devices
        self._allocs = {getattr(getattr(torch.ops.aten, op), overload)
                        for op, overload in (n.split(".") for n in _ALLOCATIONS)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._allocs and isinstance(out, torch.Tensor) and out.device.type in self.devices:
            try:
                out.zero_()
            except RuntimeError:   # a dtype without fill on this build: left as allocated
                pass
        return out


class DryLaunches:
    """While active (in this thread): a Triton launch submits its variant's compile to
    AsyncCompileMode and launches nothing. Counts the launches it turned dry."""

    _lock = threading.Lock()
    _active: DryLaunches | None = None

    def __init__(self):
        self.launches = 0
        self.thread = threading.get_ident()
        self.compiles: dict[str, int] = {}   # kernel name -> variants submitted to compile
        self.shipped = 0                     # of them, those sent to the compile processes
        self.futures: dict[int, object] = {}   # those compiles by id (a variant launched again shares its own)

    def count(self, kernel_name: str) -> None:
        """One more variant of this kernel submitted to compile."""
        self.compiles[kernel_name] = self.compiles.get(kernel_name, 0) + 1

    def compiled(self) -> list:
        """The CompiledKernels of the variants this pass submitted (once AsyncCompileMode has
        waited for them; a variant whose compile failed is left out)."""
        return [k for k in (getattr(f, "kernel", None) for f in self.futures.values()) if k is not None]

    def summary(self) -> str:
        """The kernels compiled, the most variants first: `name xN, ...`."""
        ranked = sorted(self.compiles.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{name} x{n}" for name, n in ranked) or "none"

    @contextlib.contextmanager
    def patched(self, kernel_class=None):
        """kernel_class: whose launches turn dry (Triton's JITFunction; the tests' CPU runs pass
        the interpreter's InterpretedFunction, whose warmup launches nothing either)."""
        if kernel_class is None:
            from triton.runtime.jit import JITFunction as kernel_class
        original = kernel_class.run
        dry = self

        def run(self, *args, grid, warmup, **kwargs):
            if warmup or threading.get_ident() != dry.thread:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            dry.launches += 1
            kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
            if type(kernel).__name__ == "FutureKernel" and id(kernel) not in dry.futures:   # a new variant
                dry.futures[id(kernel)] = kernel
                dry.count(getattr(getattr(self, "fn", None), "__name__", "?"))
            return kernel

        with DryLaunches._lock:
            if DryLaunches._active is not None:
                raise RuntimeError("a dry pass is already running")
            DryLaunches._active, kernel_class.run = self, run
        try:
            yield self
        finally:
            with DryLaunches._lock:
                DryLaunches._active, kernel_class.run = None, original


def dry_running() -> bool:
    """Whether a dry run is in progress (its phase then logs nothing of its own)."""
    return DryLaunches._active is not None


def run_compiled_ahead(phase: Callable[[], T], device: torch.device, name: str = "phase") -> T:
    """phase(), its Triton kernels compiled first in parallel by a dry run of it (module
    docstring); phase() alone when threads(device) is 0."""
    compile_ahead(phase, device, name)
    return phase()


def compile_ahead(phase: Callable[[], object], device: torch.device, name: str = "phase") -> None:
    """A dry run of phase() (module docstring): the Triton variants it would launch compiled
    in parallel, nothing launched. A dry run that fails is logged; the phase then compiles
    whatever it did not as it runs, as before. Nothing when threads(device) is 0."""
    n = threads(device)
    if n > 0:
        _dry_run(phase, n, name)


def _dry_run(phase: Callable[[], object], num_threads: int, name: str) -> None:
    import triton
    t0 = time.perf_counter()
    dry = DryLaunches()
    with ThreadPoolExecutor(num_threads, thread_name_prefix="loom-compile") as pool:
        try:
            with triton.AsyncCompileMode(pool, ignore_errors=True), dry.patched(), ZeroedAllocations(), \
                    _shipped_to(_processes, dry):
                phase()
                launched = time.perf_counter() - t0
        except Exception as e:   # noqa: BLE001 - the real run compiles whatever this one did not
            logger.warning("compiling the %s's kernels ahead failed (%s: %s); they compile as it runs",
                           name, type(e).__name__, e)
            return
        if _processes is not None:
            _processes.wait()
            if failed := _processes.take_failed():
                logger.warning("%d kernel variants failed to compile in a process (they compile at their first "
                               "launch): %s", len(failed), "; ".join(failed[:3]))
        compiled = time.perf_counter() - t0
        device = torch.device("cuda", torch.cuda.current_device())
        kernels = dry.compiled()
        list(pool.map(lambda kernel: _load(kernel, device), kernels))
    torch.cuda.synchronize(device)
    logger.debug("compiled the %s's kernels ahead: %d launches dry in %.2f s, %d variants compiled (%d in processes) "
                 "after %.2f s, loaded after %.2f s: %s", name, dry.launches, launched, sum(dry.compiles.values()),
                 dry.shipped, compiled, time.perf_counter() - t0, dry.summary())


@contextlib.contextmanager
def _shipped_to(processes: CompileProcesses | None, dry: DryLaunches):
    """While active: a new variant the dry pass meets is compiled by a compile process
    (workers/compile_processes.py) when its kernel can be imported there by name; Triton's
    jit_cache_hook, called before a variant compiles, ships its specialization data and skips the
    compile here. A placeholder in the kernel's cache makes the variant's later dry launches find
    it (they launch nothing); the placeholders are gone when the pass ends, so that the real run
    loads each variant from the disk cache. Other variants compile in the threads as before, and
    so do all while no process is ready yet (children still importing torch: a dry pass that
    waited for them would be slower than the threads)."""
    if processes is None:
        yield
        return
    from triton import knobs
    placed: list[tuple[dict, object]] = []

    def ship(*, key, fn=None, compile=None, is_manual_warmup=False, **_) -> bool:
        jit = getattr(fn, "jit_function", None)
        if (threading.get_ident() != dry.thread or not is_manual_warmup or jit is None or not compile
                or "specialization_data" not in compile or processes.ready == 0):
            return False   # (a thread compiles it)
        module, name = jit.fn.__module__, jit.fn.__qualname__
        if getattr(sys.modules.get(module), name, None) is not jit:   # (made at run time: not importable)
            return False
        cache = jit.device_caches[compile["device"]][0]
        cache[key] = _SHIPPED
        placed.append((cache, key))
        dry.shipped += 1
        dry.count(name)
        processes.submit(CompileJob(module, name, compile["specialization_data"]))
        return True

    runtime = knobs.runtime
    previous, runtime.jit_cache_hook = runtime.jit_cache_hook, ship
    try:
        yield
    finally:
        runtime.jit_cache_hook = previous
        for cache, key in placed:
            if cache.get(key) is _SHIPPED:
                del cache[key]


def _load(kernel, device: torch.device) -> None:
    """A compiled variant made launchable, in a compile thread: its launcher built (Triton 3.6
    compiles a C stub per signature with the host compiler, ~0.1-0.3 s, cached on disk) and its
    binary loaded into the CUDA context. Otherwise its first real launch does both, one variant
    after another on the phase's thread. A failure (a variant over the GPU's shared memory, say)
    is left for that launch to raise, as it would have."""
    torch.cuda.set_device(device)
    try:
        kernel._init_handles()   # (Triton's own first-launch step; a Triton without it loads at the launch)
    except Exception:   # noqa: BLE001 - raised again at the variant's launch
        pass
