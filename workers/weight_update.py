"""Weight updates of a running worker's model (for RL trainers), under SGLang's names.

Three sources: a checkpoint directory (`update_from_disk`), a trainer's own process group
(`init_group`, then `update_from_distributed`, broadcasts from the trainer's rank 0), and
tensors shared by a process on the same host (`update_from_tensors`, ipc/tensor_handles.py).

Every tensor goes through the model's own `load_weights` (partial mode), so fused parameters
(qkv_proj, gate_up_proj) are filled from their parts and, with tensor parallelism, each rank
keeps only its shard. Weights are copied INTO the existing parameter storage, so captured
CUDA graphs stay valid. Every tensor is checked (name, shape, dtype: the checkpoint's names and
shapes, any floating dtype, cast to the model's) before any is copied: a bad update leaves
the old weights intact.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from ipc import envs
from ipc.process_group import init_custom_process_group
from ipc.tensor_handles import decode_handles, open_tensors, parse_dtype
from workers.distributed import tp_rank
from workers.model_loader import checkpoint_metadata, safetensors_files, iterate_safetensors
from workers.models.layers import RowParallelLinear, VocabParallelEmbedding
from workers.models.moe import FusedMoE

logger = logging.getLogger(__name__)

GROUP_TIMEOUT = timedelta(minutes=10)   # a trainer that joined but never sends fails the call after this
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def expected_shapes(model, model_dir: str, load_format: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint (HF) name -> full (unsharded) shape of every tensor a weight update may send:
    the checkpoint's own listing, or for dummy weights the model's parameters at TP=1 with fused
    ones split into their parts."""
    out = {}
    if load_format != "dummy":
        out = {n: shape for n, (shape, _) in checkpoint_metadata(safetensors_files(model_dir)).items()}
    else:
        for pname, p in model.named_parameters():
            if getattr(p, "shard_ids", None) == ():   # computed, not a checkpoint's (online FP8 scales)
                continue
            full = tuple(getattr(p, "full_shape", p.shape))   # the TP=1 shape of a sharded parameter
            part_shape = getattr(p, "part_shape", None)   # stacked from parts of one shape (MoE experts)
            if part_shape is not None:
                out.update((pname.replace(fused, part), part_shape) for fused, part, sid in model.stacked_params
                           if fused in pname and sid in p.shard_ids)
                continue
            shards = getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "shards", {None: None})
            if list(shards) == [None] or not any(fused in pname for fused, _, _ in model.stacked_params):
                out[pname] = full   # unfused, or fused in the checkpoint too (Phi-3's qkv_proj)
                continue
            for fused, part, sid in model.stacked_params:
                if fused in pname and sid in shards:
                    out[pname.replace(fused, part)] = (shards[sid].full, *full[1:])
    embed = out.get("model.embed_tokens.weight")
    if getattr(model, "tie_word_embeddings", False) and embed is not None:
        out.setdefault("lm_head.weight", embed)   # a trainer's state_dict() names the tied weight twice
    return out


def check_checkpoint_dir(model_path: str, served_config) -> None:
    """ValueError unless model_path is a model directory of the served architecture (checked
    before anything loads: a path that is not a directory went on to the Hub)."""
    config_path = os.path.join(model_path, "config.json")
    if not model_path or not os.path.isfile(config_path):
        raise ValueError(f"model_path {model_path!r} is not a model directory (no config.json)")
    try:
        with open(config_path) as f:
            archs = json.load(f).get("architectures")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"model_path {model_path!r}: its config.json does not read ({type(e).__name__})") from None
    ours = getattr(served_config, "architectures", None)
    if archs != ours:
        raise ValueError(f"model_path {model_path!r} holds {archs}, but the served model is {ours}")


class GroupJoin:
    """A trainer's group being joined on a thread of its own: the join waits until the trainer
    (rank 0) and every other rank are there, up to `join_timeout` (--weight-update-join-timeout-s:
    a trainer that never joins, a wrong address or port, fails init_weights_update_group after it,
    not after GROUP_TIMEOUT; meanwhile the engine keeps stepping, as SGLang's scheduler waits)."""

    def __init__(self, group_name: str, backend: str, master_address: str, master_port: int, world_size: int,
                 rank: int, join_timeout: timedelta):
        self.backend, self.address, self.port = backend, master_address, master_port
        self.world_size, self.rank, self.join_timeout = world_size, rank, join_timeout
        self.group: dist.ProcessGroup | None = None
        self.error: Exception | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + join_timeout.total_seconds()
        self._thread = threading.Thread(target=self._join, args=(group_name,), daemon=True,
                                        name=f"join-{group_name}")
        self._thread.start()

    def done(self) -> bool:
        """Finished, or past join_timeout: torch's store client may retry its connection after the
        timeout (an address that does not answer took 288 s at 120), and the caller waits no longer."""
        with self._lock:
            if self._thread.is_alive() and time.monotonic() > self._deadline and not self._abandoned:
                self._abandoned = True   # a group it forms after all is torn down (_join)
                self.error = ValueError(f"the trainer's group at {self.address}:{self.port} did not form "
                                        f"within {self.join_timeout.total_seconds():g} s")
            return self._abandoned or not self._thread.is_alive()

    def _join(self, group_name: str) -> None:
        try:
            group = join_trainer_group(self.backend, self.address, self.port, self.world_size, self.rank,
                                       group_name, self.join_timeout)
            error = None
        except Exception as e:   # raised by the next call that names the group (group_ready)
            group, error = None, e
        with self._lock:
            if not self._abandoned:
                self.group, self.error = group, error
                return
        if group is not None:
            dist.destroy_process_group(group)


class WeightUpdater:
    """One worker's weight updates and its trainer process groups."""

    def __init__(self, runner, rank: int):
        self.runner = runner
        self.rank = rank      # the tensor-parallel rank: rank_offset + rank in a trainer's group
        self.expected = expected_shapes(runner.model, runner.weights_dir, runner.config.load_format)
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.joining: dict[str, GroupJoin] = {}   # groups still forming, by name
        self.join_timeout = timedelta(seconds=runner.config.weight_update_join_timeout_s
                                      or envs.LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S)

    @property
    def model(self):
        return self.runner.model

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # ------------------------------------------------------------ checks

    def check(self, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype | str]]) -> None:
        """ValueError naming every bad tensor (unknown name, wrong shape, non-float dtype)."""
        bad, seen = [], set()
        for name, shape, dtype in entries:
            shape = tuple(shape)
            want = self.expected.get(name)
            if name in seen:
                bad.append(f"{name!r} appears twice")
            elif want is None:
                bad.append(f"{name!r} is not a weight of this model")
            elif shape != want:
                bad.append(f"{name!r} has shape {list(shape)}, expected {list(want)}")
            elif not isinstance(dtype, torch.dtype) or dtype not in _FLOAT_DTYPES:
                bad.append(f"{name!r} has dtype {dtype}, expected a floating-point dtype")
            seen.add(name)
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise ValueError(f"bad weight update, nothing was changed: {'; '.join(bad[:5])}{more}")

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        with torch.inference_mode():
            n = len(self.model.load_weights(weights, partial=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return n

    # ------------------------------------------------------------ from disk

    def update_from_disk(self, model_path: str, load_format: str = "auto") -> int:
        if load_format not in ("auto", "safetensors"):
            raise ValueError(f"load_format must be 'auto' or 'safetensors' for a weight update, got {load_format!r}")
        check_checkpoint_dir(model_path, self.model.config)
        try:
            files = safetensors_files(model_path)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        meta = checkpoint_metadata(files)
        self.check((n, shape, _safetensors_dtype(dt)) for n, (shape, dt) in meta.items())
        ignore = getattr(self.model, "_ignore_weight", lambda name: False)
        missing = sorted(n for n in self.expected if n not in meta and not ignore(n))
        if missing:
            raise ValueError(f"the checkpoint in {model_path!r} lacks {len(missing)} weights, nothing was "
                             f"changed: {', '.join(missing[:5])}")
        n = self._load(iterate_safetensors(files, self.device))
        self.runner.weights_dir = model_path   # sleep level 2 reloads these
        return n

    # ------------------------------------------------------------ from a trainer's process group

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> None:
        """Start joining a trainer's group; the join runs on its own thread, since it waits for the
        trainer and the step loop must not (`group_ready` tells when it has formed)."""
        self._settle(group_name)
        if group_name in self.groups or group_name in self.joining:
            raise ValueError(f"weight update group {group_name!r} already exists: destroy it first")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs GPU workers; these run on the CPU: use 'gloo'")
        rank = rank_offset + self.rank
        if not 0 < rank < world_size:
            raise ValueError(f"rank_offset {rank_offset} gives worker {self.rank} rank {rank}, outside "
                             f"1..{world_size - 1} of world_size {world_size} (the trainer is rank 0)")
        self.joining[group_name] = GroupJoin(group_name, backend, master_address, master_port, world_size, rank,
                                             self.join_timeout)

    def group_ready(self, group_name: str) -> bool:
        """Whether the group has formed (False: still joining); a failed join raises its error once."""
        self._settle(group_name)
        if group_name in self.groups:
            return True
        if group_name in self.joining:
            return False
        raise ValueError(f"no weight update group {group_name!r}: call init_weights_update_group first")

    def _settle(self, group_name: str) -> None:
        """Move a finished join into `groups`, or raise its error (and forget it)."""
        join = self.joining.get(group_name)
        if join is None or not join.done():
            return
        del self.joining[group_name]
        if join.error is not None:
            raise join.error
        self.groups[group_name] = join.group
        logger.info("joined weight update group %r as rank %d of %d (%s)", group_name, join.rank, join.world_size,
                    join.backend)

    def _group(self, group_name: str) -> dist.ProcessGroup:
        self._settle(group_name)
        if group_name in self.joining:
            raise ValueError(f"weight update group {group_name!r} is still forming: wait for "
                             f"init_weights_update_group to return")
        pg = self.groups.get(group_name)
        if pg is None:
            raise ValueError(f"no weight update group {group_name!r}: call init_weights_update_group first")
        return pg

    def destroy_group(self, group_name: str) -> None:
        """Leave a trainer's group. Tearing down an NCCL communicator waits for the trainer's own
        teardown (the ranks finalize together), which may come only after this call has answered:
        it runs on a thread of its own."""
        pg = self._group(group_name)
        del self.groups[group_name]
        threading.Thread(target=dist.destroy_process_group, args=(pg,), daemon=True,
                         name=f"leave-{group_name}").start()

    def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                group_name: str) -> int:
        """Receive one broadcast from the trainer's rank 0 per name, in order, and load each."""
        pg = self._group(group_name)
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        # an unknown dtype or a negative size: the broadcasts cannot even be taken and dropped
        parsed = [parse_dtype(d) for d in dtypes]
        bad = [n for n, s in zip(names, shapes) if any(d < 0 for d in s)]
        if bad:
            raise ValueError(f"negative sizes in the shapes of {bad[:5]}")
        try:
            self.check(zip(names, shapes, parsed))
        except ValueError:
            for d, s in zip(parsed, shapes):   # take the broadcasts anyway: the trainer must not hang
                self._receive(pg, d, s)
            raise
        return self._load((n, self._receive(pg, d, s)) for n, d, s in zip(names, parsed, shapes))

    def _receive(self, pg: dist.ProcessGroup, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = GROUP_TIMEOUT
        pg.broadcast([buf], opts).wait()
        return buf

    # ------------------------------------------------------------ from shared tensors

    def update_from_tensors(self, raw_handles: list) -> int:
        handles = decode_handles(raw_handles)
        self.check((h.name, h.shape, _try_dtype(h.dtype)) for h in handles)
        with open_tensors(handles, self.device) as named:
            return self._load(named)

    # ------------------------------------------------------------ reading back

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict:
        """This rank's part of the first `truncate_size` rows of a weight (checkpoint name), as
        float32 lists: {"dim": the dimension it is split on (None: whole), "start": where this
        rank's part begins on it, "values"}; ipc/control.py's `merge_weight_rows` joins the ranks' parts.
        values None: this rank holds none of it (an expert of another rank)."""
        if name not in self.expected:
            raise ValueError(f"{name!r} is not a weight of this model")
        if truncate_size < 0:  # here, so that /collective_rpc checks it too
            raise ValueError(f"truncate_size must be at least 0, got {truncate_size}")
        pname, sid = name, None
        for fused, part, shard_id in getattr(self.model, "stacked_params", ()):
            if part in name:
                pname, sid = name.replace(part, fused), shard_id
                break
        try:
            t = self.model.get_parameter(pname).detach()
        except AttributeError:   # a checkpoint name the model renames (vision-language models)
            raise ValueError(f"{name!r} cannot be read back by name on {type(self.model).__name__}") from None
        module = self.model.get_submodule(pname.rsplit(".", 1)[0])
        scale = getattr(module, "weight_scale", None)
        if getattr(module, "quant_method", None) is not None and pname.endswith(".weight") and scale is not None \
                and scale.dim() == 1:
            t = t.float() * scale[:, None]   # FP8 per channel: read back dequantized
        dim, start = None, 0
        if isinstance(module, FusedMoE) and sid is not None:   # one expert's part of a stacked tensor
            held = module.checkpoint_part(pname, sid)
            if held is None:   # the expert is another rank's (expert parallelism)
                return {"dim": None, "start": 0, "values": None}
            t, dim, start = held
        elif sid in getattr(module, "shards", {}):                 # column-parallel (a fused part)
            shard = module.shards[sid]
            t, dim, start = t.narrow(0, shard.offset, shard.size), 0, shard.start
        elif isinstance(module, RowParallelLinear) and t.dim() == 2:
            dim, start = 1, tp_rank() * module.in_features
        elif isinstance(module, VocabParallelEmbedding):      # padding rows past the vocabulary dropped
            dim, start = 0, module.vocab_start
            t = t[:max(0, min(module.part, module.vocab_size - start))]
        t = t[:truncate_size].float() - getattr(self.model.get_parameter(pname), "stored_offset", 0.0)
        return {"dim": dim, "start": start, "values": t.cpu().tolist()}


def join_trainer_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                       group_name: str, join_timeout: timedelta) -> dist.ProcessGroup:
    """This worker's side of a trainer's group: the same group the trainer builds with
    ipc/process_group.py (TCP rendezvous at the trainer's store, keys under `group_name`)."""
    host = f"[{master_address}]" if ":" in master_address else master_address
    try:
        return init_custom_process_group(backend, f"tcp://{host}:{master_port}", GROUP_TIMEOUT, world_size, rank,
                                         group_name=group_name, join_timeout=join_timeout)
    except RuntimeError as e:   # DistStoreError (a timeout) is one; no trainer where the caller said (a 400)
        raise ValueError(f"the trainer's group at {host}:{master_port} did not form within "
                           f"{join_timeout.total_seconds():g} s: {str(e).splitlines()[0][:300]}") from None


def _safetensors_dtype(name: str) -> torch.dtype | str:
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(name, name)


def _try_dtype(name: str) -> torch.dtype | str:
    try:
        return parse_dtype(name)
    except ValueError:
        return name
