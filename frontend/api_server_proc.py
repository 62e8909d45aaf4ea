"""Entry point of one API-server process (client_index i of the engine core)."""
from __future__ import annotations

import asyncio
import logging
import os

from ipc.config import EngineConfig
from ipc.procs import child_signals, watch_parent
from ipc.profiling import maybe_profile


_DEAD_ENGINE_GRACE_S = 1.5  # answer 503 for a moment, then exit non-zero


async def _exit_when_dead(llm) -> None:
    while not llm.is_dead:
        await asyncio.sleep(0.1)
    logging.getLogger(__name__).error("engine is dead (%s); exiting", llm.dead_reason)
    await asyncio.sleep(_DEAD_ENGINE_GRACE_S)
    os._exit(1)


def run_api_server_process(config_dict: dict, server_opts: dict, client_index: int, input_address: str,
                           output_address: str, listen_sock, death_pipe) -> None:
    watch_parent(death_pipe)
    child_signals()
    logging.basicConfig(level=os.environ.get("LOOM_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s api{client_index} %(levelname)s %(message)s")
    import uvloop
    from frontend.api_server import serve
    from frontend.async_llm import AsyncLLM

    opts = dict(server_opts)
    engine_address, auth_key = opts.pop("engine_address", None), opts.pop("engine_auth_key", None)
    dp_lookup = opts.pop("dp_lookup", None)

    async def _main():
        llm = AsyncLLM(EngineConfig.from_dict(config_dict), input_address, output_address, client_index)
        try:
            remote = []
            if dp_lookup:   # data-parallel ranks on other nodes: where the head's coordinator says they are
                from engine_core.dp_coordinator import lookup_remote_engines
                found = await asyncio.get_running_loop().run_in_executor(None, lookup_remote_engines, dp_lookup)
                remote = [found[r] for r in sorted(found)]
            await llm.start(engine_address=engine_address, auth_key=auth_key, remote_engines=remote)
            if engine_address or remote:  # no parent watches a remote engine: leave when it dies
                asyncio.get_running_loop().create_task(_exit_when_dead(llm))
            from metrics.attach import attach_metrics
            attach_metrics(llm, enable_mfu=opts.pop("enable_mfu_metrics", False))
            await serve(llm, sock=listen_sock, **opts)
        finally:
            llm.close()

    try:
        with maybe_profile(f"api_server{client_index}"):
            uvloop.run(_main())
    except (KeyboardInterrupt, SystemExit):
        pass
