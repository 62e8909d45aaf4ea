"""Entry point of one API-server process (client_index i of the engine core)."""
from __future__ import annotations

import asyncio
import logging
import os

from engine_core.config import EngineConfig
from ipc.procs import child_signals, watch_parent


def run_api_server_process(config_dict: dict, server_opts: dict, client_index: int, input_address: str,
                           output_address: str, listen_sock, death_pipe) -> None:
    watch_parent(death_pipe)
    child_signals()
    logging.basicConfig(level=os.environ.get("LOOM_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s api{client_index} %(levelname)s %(message)s")
    import uvloop
    from frontend.api_server import serve
    from frontend.async_llm import AsyncLLM

    async def _main():
        llm = AsyncLLM(EngineConfig.from_dict(config_dict), input_address, output_address, client_index)
        try:
            await llm.start()
            await serve(llm, sock=listen_sock, **server_opts)
        finally:
            llm.close()

    try:
        uvloop.run(_main())
    except (KeyboardInterrupt, SystemExit):
        pass
