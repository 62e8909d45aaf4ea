"""Checkpoint tensors -> the model's parameters. A model declares two things (see
docs/adding_a_model.md): `hf_to_loom(name)`, its checkpoint name for a parameter name of ours
(None: a checkpoint tensor it does not load), and `stacked_params`, the checkpoint parts of
its fused parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj). `load_weights` applies
both; every parameter's own weight loader then keeps this rank's shard."""
from __future__ import annotations

from typing import Iterable

from torch import nn

from workers.models.kv_scales import KVScaleLoader

# (our fused parameter, checkpoint part, shard id): the decoder blocks' fused projections
STACKED_PARAMS = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, object]], partial: bool = False) -> set[str]:
    """Load HF-named tensors (or safetensors slices) through the model's declarations:
    `model.hf_to_loom` renames (None: skipped), `model.stacked_params` routes fused parts.
    `partial`: only some tensors (a weight update). Errors as load_stacked_weights'."""
    kv_scales = KVScaleLoader(model)   # an FP8 checkpoint's k_scale / v_scale go to the attention layers

    def renamed():
        for name, tensor in weights:
            if not kv_scales.take(name, tensor):
                yield model.hf_to_loom(name), name, tensor

    return _load(model, renamed(), model.stacked_params, partial)


def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, object]],
                         stacked_mapping: list[tuple[str, str, object]],
                         ignore: callable = lambda name: False, partial: bool = False) -> set[str]:
    """Hand each checkpoint tensor (or safetensors slice) to its parameter's weight loader,
    which keeps this rank's shard, copied in place (param.data is never replaced, so captured
    CUDA graphs stay valid).

    stacked_mapping: (our_fused_name, checkpoint_name, shard_id) substring
    rewrites, e.g. (".qkv_proj.", ".q_proj.", "q"). Raises ValueError on a
    duplicate checkpoint name, a shape mismatch, checkpoint weights that map to
    nothing, or (unless `partial`: a weight update of some tensors) parameters
    (or shards of fused ones) left unloaded. Returns the set of checkpoint names loaded."""
    return _load(model, ((None if ignore(n) else n, n, t) for n, t in weights), stacked_mapping, partial)


def _load(model: nn.Module, weights: Iterable[tuple[str | None, str, object]],
          stacked_mapping: list[tuple[str, str, object]], partial: bool) -> set[str]:
    """weights: (our name before the fused-part rewrite (None: skip), checkpoint name, tensor).
    A name is a duplicate (and counts as loaded) under our name, the checkpoint's when skipped."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, orig_name, tensor in weights:
        key = orig_name if ckpt_name is None else ckpt_name
        if key in seen:
            raise ValueError(f"weight {key!r} appears twice in the checkpoint")
        seen.add(key)
        if ckpt_name is None:
            continue
        name, shard_id = ckpt_name, None
        for fused, part, sid in stacked_mapping:
            if part in ckpt_name:
                name, shard_id = ckpt_name.replace(part, fused), sid
                break
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"weight {ckpt_name!r}: {e}") from None
        # a fused tensor as a whole (Phi-3's qkv_proj, gate_up_proj) fills every part
        loaded.setdefault(name, set()).update(param.shard_ids if shard_id is None else (shard_id,))

    missing = []
    for name, param in params.items() if not partial else ():
        got = loaded.get(name, set())
        missing += [name if s is None else f"{name}[{s}]" for s in param.shard_ids if s not in got]
    if unexpected or missing:
        msg = []
        if unexpected:
            msg.append(f"checkpoint weights with no matching parameter: {_short(unexpected)}")
        if missing:
            msg.append(f"parameters not loaded from the checkpoint: {_short(missing)}")
        raise ValueError(f"{type(model).__name__}: " + "; ".join(msg))
    return seen


def _short(names: list[str], n: int = 10) -> str:
    more = f" ... (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(sorted(names)[:n]) + more
