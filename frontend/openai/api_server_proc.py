"""Entry point of one API-server process (client_index i of the engine core).

Stopping: `loom serve` asks for a drain on the death pipe (it got SIGTERM / SIGINT): new requests
get 503, requests in flight get `shutdown_timeout` seconds, and whatever is left ends with an
error (an error event and [DONE] for a stream, a 503 body otherwise); then exit 0. A SIGTERM sent
to this process itself does the same with no grace, and exits 1 so that `loom serve` stops too.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from ipc.config import EngineConfig
from ipc.procs import child_signals, freeze_startup_heap, sigterm_exits, stop_requested, watch_parent
from ipc import envs, profiling
from ipc.profiling import maybe_profile
from metrics.multiproc import ENV as METRICS_DIR_ENV

logger = logging.getLogger(__name__)
_DEAD_ENGINE_GRACE_S = 1.5  # answer 503 for a moment, then exit non-zero
_FLUSH_S = 0.3              # after failing what is left: at most this for the handlers to write their last bytes


async def _exit_when_dead(llm) -> None:
    while not llm.is_dead:
        await asyncio.sleep(0.1)
    logger.error("engine is dead (%s); exiting", llm.dead_reason)
    await asyncio.sleep(_DEAD_ENGINE_GRACE_S)
    os._exit(1)


async def _shut_down(llm, server, grace: float, code: int, why: str) -> None:
    """Refuse new requests, give those in flight `grace` seconds, fail the rest, exit `code`
    once their handlers wrote the errors (`server`: the OpenAIServer, None before it is built)."""
    from frontend.openai.protocol import APIError
    llm.draining = True
    logger.info("%s: shutting down; %d requests in flight get %.1fs", why, llm.num_in_flight, grace)
    deadline = time.monotonic() + grace
    while llm.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if llm.num_in_flight:
        logger.warning("%s: failing %d requests still in flight", why, llm.num_in_flight)
        llm.fail_all(APIError(f"The server is shutting down ({why}); the request did not finish in time.", 503))
    if server is not None:
        await server.handlers_done(_FLUSH_S)
    profiling.dump()   # LOOM_PROFILE_DIR: os._exit skips the profile's own exit
    os._exit(code)


def one_intra_op_thread() -> None:
    """Torch's (and OpenBLAS's) intra-op threads in this process: one, unless OMP_NUM_THREADS
    says otherwise; set before torch is first imported, which reads it then. An API server's
    torch work is its media processors' (a clip's log-mel spectrogram, an image's resize), on
    LOOM_MEDIA_LOADING_THREAD_COUNT threads of their own, in each of --api-server-count
    processes: with torch's default, one OpenMP thread per core, every call fanned out over
    every core, and a team waited for its member that another process held off its core
    (Whisper-large-v3's log-mel of a 20 s clip on a 2-core box whose cores two other processes
    keep busy, as a server's engine core and worker do: 8.5 ms wall and 4.6 ms of CPU with one
    thread, 142 ms and 56 ms with two; `bench/whisper_host.py --busy 2 --threads 0|1`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_api_server_process(config_dict: dict, server_opts: dict, client_index: int, input_address: str,
                           output_address: str, listen_sock, death_pipe) -> None:
    one_intra_op_thread()
    loop_box: list = []   # the event loop, once it runs (the parent-watch thread posts to it)
    opts = dict(server_opts)
    shutdown_timeout = float(opts.pop("shutdown_timeout", 5.0))

    def on_drain() -> None:
        if not loop_box:
            os._exit(0)   # nothing was served yet
        loop, llm, server = loop_box
        loop.call_soon_threadsafe(lambda: loop.create_task(
            _shut_down(llm, server[0], shutdown_timeout, 0, "loom serve stopping")))

    watch_parent(death_pipe, on_drain=on_drain, remove_dirs=(os.environ.get(METRICS_DIR_ENV),))
    child_signals()
    logging.basicConfig(level=envs.LOOM_LOG_LEVEL,
                        format=f"%(asctime)s api{client_index} %(levelname)s %(message)s")
    import uvloop
    from frontend.openai.api_server import serve
    from frontend.async_llm import AsyncLLM

    engine_address, auth_key = opts.pop("engine_address", None), opts.pop("engine_auth_key", None)
    dp_lookup = opts.pop("dp_lookup", None)

    async def _main():
        llm = AsyncLLM(EngineConfig.from_dict(config_dict), input_address, output_address, client_index)
        loop = asyncio.get_running_loop()
        server: list = [None]   # the OpenAIServer, once serve() built it
        # (child_signals' rule: while `loom serve` lives its SIGTERM is passed there, which drains us)
        loop.add_signal_handler(signal.SIGTERM, lambda: sigterm_exits() and loop.create_task(
            _shut_down(llm, server[0], 0.0, 0 if stop_requested() else 1, "SIGTERM")))
        loop_box[:] = [loop, llm, server]
        try:
            remote = []
            if dp_lookup:   # data-parallel ranks on other nodes: where the head's coordinator says they are
                from ipc.data_parallel import lookup_remote_engines
                found = await loop.run_in_executor(None, lookup_remote_engines, dp_lookup)
                remote = [found[r] for r in sorted(found)]
                llm.router.remote = frozenset(found)   # images (in this host's store) go to local ranks only
            try:
                await llm.start(engine_address=engine_address, auth_key=auth_key, remote_engines=remote)
            except (PermissionError, TimeoutError) as e:   # a wrong key or address: one line, not a traceback
                logger.error("cannot attach to the engine: %s", e)
                os._exit(1)
            if engine_address or remote:  # no parent watches a remote engine: leave when it dies
                loop.create_task(_exit_when_dead(llm))
            from metrics.attach import attach_metrics
            attach_metrics(llm, enable_mfu=opts.pop("enable_mfu_metrics", False))
            # as the engine core and the workers: the stats line's metrics merge (every
            # --log-stats-interval) set off full collector passes over transformers' and the
            # tokenizer's start-up objects, ~0.3 s of this loop's CPU each at c512 (a profile)
            freeze_startup_heap()
            await serve(llm, sock=listen_sock, on_built=lambda s: server.__setitem__(0, s), **opts)
        finally:
            llm.close()

    try:
        with maybe_profile(f"api_server{client_index}"):
            uvloop.run(_main())
    except (KeyboardInterrupt, SystemExit):
        pass
