"""Which Worker methods may be called from outside the worker (collective RPC).

A light module (no torch): the engine core and the API servers check method
names here before anything reaches a worker.
"""
from __future__ import annotations

# Remote methods that change state the engine core tracks (the KV cache, sleep state, the
# process itself): only the engine calls them; to clients, the hint says what to use instead.
ENGINE_ONLY_WORKER_METHODS: dict[str, str] = {
    "sleep": "use POST /sleep",
    "wake_up": "use POST /wake_up",
    "initialize_cache": "the KV cache is the engine's",
    "determine_num_blocks": "the KV cache is the engine's",
    "shutdown": "use SIGTERM on `loom serve`",
    # weights: the engine checks that nothing steps, then resets the prefix cache
    "update_weights_from_disk": "use POST /update_weights_from_disk",
    "update_weights_from_distributed": "use POST /update_weights_from_distributed",
    "update_weights_from_tensor": "use POST /update_weights_from_tensor",
    # it returns before the group forms; the engine answers once it has
    "init_weights_update_group": "use POST /init_weights_update_group",
}


def remote(fn):
    """Mark a Worker method as callable through collective_rpc."""
    fn._loom_remote = True
    return fn


def is_remote(cls, name: str) -> bool:
    """Whether `name` is a @remote method of `cls` that clients may call."""
    return (not name.startswith("_") and name not in ENGINE_ONLY_WORKER_METHODS
            and getattr(getattr(cls, name, None), "_loom_remote", False) is True)
