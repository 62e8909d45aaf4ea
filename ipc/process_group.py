"""A process group of its own between an RL trainer and the serving workers, as SGLang ships it.

Both ends of `/init_weights_update_group` build the same group: the trainer (rank 0, which hosts
the TCP store) and each worker (workers/weight_update.py, rank `rank_offset + w`). Neither has
(or wants) torch's default group, which `dist.new_group` needs, so the group is built the way
SGLang's `init_custom_process_group` and the trainer clients (TorchRL, OpenRLHF, slime) do:
a TCP rendezvous, a PrefixStore named after the group, torch's private
`_new_process_group_helper`, and the group's rank table in `_world.pg_group_ranks` (without it
the first `dist.broadcast(..., group=pg)` fails with a KeyError). Those private pieces live
here alone, so that a trainer imports this function and never touches `_world`:

    from ipc.process_group import init_custom_process_group
    pg = init_custom_process_group(backend="gloo", init_method="tcp://127.0.0.1:29600",
                                   world_size=2, rank=0, group_name="weight_update_group")

Checked on torch 2.11 and 2.13; the differences it guards are older (the options keyword was
`pg_options` before torch 2.6).
"""
from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist


def init_custom_process_group(backend: str | None = None, init_method: str | None = None,
                              timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
                              store: dist.Store | None = None, group_name: str | None = None, pg_options=None,
                              *, join_timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A process group of `world_size` ranks apart from any default group (SGLang's signature).

    `init_method` is a rendezvous URL (tcp://HOST:PORT, with rank 0 hosting the store), or give
    a `store` instead. `timeout` bounds the group's collectives; `join_timeout` (ours; default:
    `timeout`) bounds the wait for every rank to join, so a trainer that never comes fails early
    while a slow broadcast still has its full time."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    if store is not None and init_method is not None:
        raise ValueError("give init_method or store, not both")
    if not group_name:
        raise ValueError("group_name is required: the group's keys in the store are prefixed with it")
    timeout = timeout if timeout is not None else timedelta(minutes=30)   # torch's default_pg_timeout
    join_timeout = join_timeout if join_timeout is not None else timeout
    base = None   # the store made here, whose timeout changes once every rank has joined
    if store is None:
        base, rank, world_size = next(rendezvous(init_method or "env://", rank, world_size, timeout=join_timeout))
        base.set_timeout(join_timeout)   # every rank joins within it (gloo connects the ranks here)
        store = PrefixStore(group_name, base)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world_size {world_size}: needs 0 <= rank < world_size")
    params = inspect.signature(_new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": pg_options}
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend or "undefined"), store,
                                      group_name=group_name, timeout=timeout, **options)
    if base is not None:
        base.set_timeout(timeout)
    # the group's rank -> global rank table: torch's collectives look the group up in it
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
