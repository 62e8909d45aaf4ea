"""A stand-in RL trainer for tests/test_weight_update_http.py: rank 0 of a weight-update group.

    python tests/_rl_trainer.py PORT WORLD_SIZE GROUP_NAME CHECKPOINT_DIR [BACKEND [DEVICE]]

(BACKEND gloo on the CPU by default; nccl with DEVICE such as cuda:1.)

It builds its side of the group with ipc/process_group.py's init_custom_process_group, the helper
SGLang ships and trainer clients copy (TCP rendezvous with rank 0 hosting the store, a PrefixStore
named after the group), prints "ready", then for each line on stdin
(JSON {"names", "dtypes", "shapes"}) broadcasts one tensor per name in order: the checkpoint's
tensor, or zeros where the declared shape or name does not fit it. Prints "sent" after each.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ipc.process_group import init_custom_process_group


def main() -> None:
    port, world_size, group_name, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    backend = sys.argv[5] if len(sys.argv) > 5 else "gloo"
    device = torch.device(sys.argv[6] if len(sys.argv) > 6 else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = load_file(os.path.join(ckpt, "model.safetensors"), device=str(device))
    pg = init_custom_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}",
                                   timeout=timedelta(seconds=120), world_size=world_size, rank=0,
                                   group_name=group_name)
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        for name, dtype, shape in zip(req["names"], req["dtypes"], req["shapes"]):
            t = weights.get(name)
            dtype = getattr(torch, dtype)
            if t is None or list(t.shape) != shape:
                t = torch.zeros(shape, dtype=dtype, device=device)
            dist.broadcast(t.to(dtype).contiguous(), src=0, group=pg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        print("sent", flush=True)
    dist.destroy_process_group(pg)


if __name__ == "__main__":
    main()
