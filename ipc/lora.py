"""LoRARequest: which LoRA adapter a request runs with (vLLM's vllm.lora.request.LoRARequest).

It travels with the request from the frontend to the engine core (which counts the distinct
adapters of a step against --max-loras and keys the prefix cache by `lora_int_id`) and on to
the workers (which load `lora_path` into a GPU slot). `lora_int_id` is unique per loaded
adapter and never 0 (0 is the base model, as in vLLM); an in-place reload keeps it.
"""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    @property
    def adapter_id(self) -> int:   # (vLLM's name)
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def block_hash_root(lora: LoRARequest | None) -> bytes | None:
    """The parent of a request's first KV block hash: None for the base model, else one per
    adapter, so that the prefix cache never hands one adapter's blocks to another (the hashes
    chain, so every later block differs too)."""
    return None if lora is None else b"lora:%d" % lora.lora_int_id
