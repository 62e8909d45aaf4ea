"""LoRAManager: a worker's adapters (vLLM's LRUCacheWorkerLoRAManager).

It owns, per worker:
  - the LoRALinear of every base linear adapters may target (attached at start, --enable-lora);
  - the adapters it knows (LoRARequest by lora_int_id: registered by add_lora, or by the first
    request that names one);
  - an LRU of adapters read from disk, on the CPU (--max-cpu-loras);
  - the GPU slots (--max-loras), each holding one adapter, reused least recently used first;
  - each running request's adapter, and, every step, the per-token slot index (LoRAContext).

The engine core's scheduler never puts more distinct adapters in one step than there are slots,
so a step's adapters always fit: those not in a slot yet replace adapters the step does not use.
A slot is rewritten on the step's stream, after the kernels of steps already in flight.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from ipc.config import EngineConfig
from ipc.lora import LoRARequest
from ipc.messages import SchedulerOutput
from workers.distributed import tp_rank, tp_size
from workers.lora.layers import LoRAContext, LoRALinear
from workers.lora.peft import LoRAAdapterError, LoRAModuleWeights, PeftAdapter, read_peft_adapter
from workers.models.layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

# the base linears adapters may target (their checkpoint parts: q/k/v, o, gate/up, down)
LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PINNED_RING = 4   # host staging buffers of the slot index: more than the steps in flight


def _attach(model: nn.Module, ctx: LoRAContext, max_loras: int, max_rank: int, dtype: torch.dtype,
            device: torch.device) -> dict[str, LoRALinear]:
    """A LoRALinear on every targetable linear of the model, by module name."""
    out = {}
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] not in LORA_TARGETS:
            continue
        if isinstance(mod, ColumnParallelLinear):
            slices = [(sid, s.start, s.size, s.offset) for sid, s in mod.shards.items()]
            lora = LoRALinear(ctx, mod.in_features, mod.out_features, slices, [s.full for s in mod.shards.values()],
                              max_loras, max_rank, dtype, device)
        elif isinstance(mod, RowParallelLinear):
            part = mod.in_features
            lora = LoRALinear(ctx, part, mod.out_features, [(None, 0, mod.out_features, 0)], [mod.out_features],
                              max_loras, max_rank, dtype, device, in_shard=(tp_rank() * part, part),
                              full_in=part * tp_size())
        else:
            continue
        mod.lora = lora
        out[name] = lora
    return out


class LoRAManager:
    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 backend: str = "torch"):
        self.model = model
        self.device = device
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = max(config.max_cpu_loras or config.max_loras, config.max_loras)
        max_tokens = max(config.max_num_batched_tokens or 0, config.max_num_seqs) + 1
        self.ctx = LoRAContext(max_tokens, device, use_triton=backend == "triton")
        self.linears = _attach(model, self.ctx, self.max_loras, self.max_rank, dtype, device)
        if not self.linears:
            raise ValueError(f"--enable-lora: {type(model).__name__} has no linear layer adapters can target "
                             f"({', '.join(LORA_TARGETS)})")
        self.known: dict[int, LoRARequest] = {}
        self.cpu: OrderedDict[int, dict[LoRALinear, dict]] = OrderedDict()   # LRU: id -> its per-linear pairs
        self.slot_of: OrderedDict[int, int] = OrderedDict()                    # LRU: id -> GPU slot
        self.req_lora: dict[str, LoRARequest] = {}   # running requests' adapters
        self._dirty = 0     # leading entries of token_slots that may hold a slot (the rest is -1)
        self._pinned = ([torch.empty(max_tokens, dtype=torch.int32, pin_memory=True) for _ in range(_PINNED_RING)]
                        if device.type == "cuda" else [])
        self._ring = 0

    # ---------------------------------------------------------------- adapters

    def _fit(self, adapter: PeftAdapter) -> dict[LoRALinear, dict]:
        """The adapter's pairs by LoRALinear and slice, every one checked against the layer;
        LoRAAdapterError for a module the model has no slot for, a rank above --max-lora-rank,
        or a shape that is not the layer's."""
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(f"{adapter.path}: rank {adapter.rank} > --max-lora-rank {self.max_rank}")
        stacked = getattr(self.model, "stacked_params", ())
        out: dict[LoRALinear, dict] = {}
        for module, weights in adapter.modules.items():
            name = self.model.hf_to_loom(module + ".weight") if hasattr(self.model, "hf_to_loom") else module + ".weight"
            sid = None
            for fused, part, shard_id in stacked:
                if name is not None and part in name:
                    name, sid = name.replace(part, fused), shard_id
                    break
            lora = self.linears.get(name[:-len(".weight")]) if name else None
            if lora is None or sid not in [s for s, *_ in lora.slices]:
                raise LoRAAdapterError(f"{adapter.path}: target module {module!r} is not one LoRA can serve on this "
                                       f"model (q/k/v/o and gate/up/down projections of its decoder layers)")
            out.setdefault(lora, {})[sid] = weights
        for lora, pairs in out.items():
            lora.check(pairs, adapter.path)
        return out

    def _read(self, req: LoRARequest) -> dict[LoRALinear, dict]:
        return self._fit(read_peft_adapter(req.lora_path))

    def add_lora(self, req: LoRARequest, load_inplace: bool = False) -> bool:
        """Read and check the adapter (nothing is kept when it does not fit), into the CPU LRU.
        load_inplace: replace the weights of an adapter already known by that id (in its GPU slot
        too: the steps after this one run the new weights)."""
        known = self.known.get(req.lora_int_id)
        if known is not None and not load_inplace:
            if known.lora_path != req.lora_path:   # (an id names one adapter: its weights are cached by it)
                raise LoRAAdapterError(f"lora_int_id {req.lora_int_id} is adapter {known.lora_name!r} "
                                       f"({known.lora_path}): remove it first, or load {req.lora_path!r} in place")
            return True
        pairs = self._read(req)
        self.known[req.lora_int_id] = req
        self._cache(req.lora_int_id, pairs)
        if req.lora_int_id in self.slot_of:
            self._write_slot(self.slot_of[req.lora_int_id], pairs)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        known = self.known.pop(lora_id, None) is not None
        self.cpu.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for lora in self.linears.values():
                lora.clear_slot(slot)
        return known

    def list_loras(self) -> list[int]:
        return sorted(self.known)

    def _cache(self, lora_id: int, pairs: dict) -> None:
        self.cpu[lora_id] = pairs
        self.cpu.move_to_end(lora_id)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _pairs(self, lora_id: int) -> dict:
        """The adapter's pairs from the CPU LRU, else read from disk again."""
        if lora_id in self.cpu:
            self.cpu.move_to_end(lora_id)
            return self.cpu[lora_id]
        pairs = self._read(self.known[lora_id])
        self._cache(lora_id, pairs)
        return pairs

    def _write_slot(self, slot: int, pairs: dict[LoRALinear, dict[object, LoRAModuleWeights]]) -> None:
        for lora in self.linears.values():
            if lora in pairs:
                lora.set_slot(slot, pairs[lora])
            else:
                lora.clear_slot(slot)

    def _activate(self, ids: set[int]) -> None:
        """Put every adapter in `ids` (at most max_loras) in a GPU slot."""
        for i in ids:
            if i in self.slot_of:
                self.slot_of.move_to_end(i)
        missing = [i for i in ids if i not in self.slot_of]
        if not missing:
            return
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        for i in missing:
            if not free:
                victim = next((v for v in self.slot_of if v not in ids), None)
                if victim is None:
                    raise RuntimeError(f"a step uses more adapters than --max-loras {self.max_loras}")
                free.append(self.slot_of.pop(victim))
            slot = free.pop()
            self._write_slot(slot, self._pairs(i))
            self.slot_of[i] = slot

    # ---------------------------------------------------------------- one step

    def prepare_step(self, so: SchedulerOutput) -> None:
        """Track the step's requests' adapters, put those it uses in slots, and write its
        per-token slot index (-1 for base rows and past the step's tokens)."""
        for rid in so.finished_req_ids:
            self.req_lora.pop(rid, None)
        for r in so.new_requests:
            if r.lora_request is not None:
                self.req_lora[r.req_id] = r.lora_request
        if not so.req_ids:
            return
        reqs = [self.req_lora.get(rid) for rid in so.req_ids]
        ids = [0 if lr is None else lr.lora_int_id for lr in reqs]
        for lr in reqs:   # (an adapter first seen with its request, or removed while one ran: read from its path)
            if lr is not None and lr.lora_int_id not in self.known:
                self.known[lr.lora_int_id] = lr
        used = set(ids) - {0}
        self.ctx.active = bool(used)
        if not used:
            if self._dirty:   # the graphs read the index too: back to all base
                self.ctx.token_slots[:self._dirty].fill_(-1)
                self._dirty = 0
            return
        self._activate(used)
        per_req = np.array([self.slot_of[i] if i else -1 for i in ids], dtype=np.int32)
        tokens = np.repeat(per_req, np.asarray(so.num_scheduled_tokens, dtype=np.int64))
        n = max(len(tokens), self._dirty)
        host = torch.full((n,), -1, dtype=torch.int32)
        host[:len(tokens)] = torch.from_numpy(tokens)
        if self._pinned:
            staged = self._pinned[self._ring][:n]
            self._ring = (self._ring + 1) % len(self._pinned)
            staged.copy_(host)
            self.ctx.token_slots[:n].copy_(staged, non_blocking=True)
        else:
            self.ctx.token_slots[:n].copy_(host)
        self._dirty = len(tokens)
