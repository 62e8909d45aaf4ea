"""Which Worker methods may be called from outside the worker (collective RPC).

A light module (no torch): the engine core and the API servers check method names here before
anything reaches a worker, without importing workers.worker. tests/test_control_table.py checks
that these two lists hold every @remote method of workers.worker.Worker.
"""
from __future__ import annotations

from ipc.control import CONTROL_OPS

# Remote methods that change state the engine core tracks (the KV cache, sleep state, the weights
# and what was cached with them, the process itself): only the engine calls them; to clients, the
# hint says what to use instead. Those of control operations: the operation's route.
ENGINE_ONLY_WORKER_METHODS: dict[str, str] = {
    **{op.workers: f"use {op.routes[0]}" for op in CONTROL_OPS.values() if op.engine_only},
    "initialize_cache": "the KV cache is the engine's",
    "determine_num_blocks": "the KV cache is the engine's",
    "initialize_cpu_tier": "the KV cache is the engine's",
    "shutdown": "use SIGTERM on `loom serve`",
    "add_lora": "use POST /v1/load_lora_adapter",
    "remove_lora": "use POST /v1/unload_lora_adapter",
}

# Remote methods clients may call through collective_rpc (POST /collective_rpc, LLM.collective_rpc).
CLIENT_WORKER_METHODS = frozenset({
    "ping", "device_type", "kv_sliding_window", "kv_block_bytes", "get_pid", "memory_info", "step_stats", "all_reduce_info",
    "weights_update_group_ready", "destroy_weights_update_group", "get_weights_by_name",
    "start_profile", "stop_profile", "list_loras",
})


def remote(fn):
    """Mark a Worker method as callable through collective_rpc."""
    fn._loom_remote = True
    return fn

