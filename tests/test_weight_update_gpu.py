"""Weight updates on the GPU (run by the lead through the device tool): CUDA IPC handles and
in-place copies under CUDA graphs, and a trainer's NCCL group (needs two GPUs). The oracle is a
fresh engine on the new checkpoint (same bf16 kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from frontend import LLM, SamplingParams
from ipc.sockets import free_tcp_port
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [50, 60, 70], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)


@pytest.fixture(scope="module")
def ckpt(model_factory):
    return model_factory("llama", **SIZES), model_factory("llama", seed=1, **SIZES)


def _gen(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ref(ckpt):
    out = {}
    for d in ckpt:
        llm = LLM(d, max_model_len=256, gpu_memory_utilization=0.3)
        try:
            out[d] = _gen(llm)
        finally:
            llm.shutdown()
    assert out[ckpt[0]] != out[ckpt[1]]
    return out


def test_cuda_ipc_update_under_cuda_graphs(ckpt, ref):
    """Decode replays graphs captured on A's parameters: they must see B's values (copied in place)."""
    a, b = ckpt
    llm = LLM(a, max_model_len=256, gpu_memory_utilization=0.3)
    try:
        assert _gen(llm) == ref[a]
        new = {n: t.to("cuda", torch.bfloat16) for n, t in load_file(os.path.join(b, "model.safetensors")).items()}
        llm.pause("keep")
        assert llm.update_weights_from_tensor(new) == len(new)
        llm.resume()
        assert _gen(llm) == ref[b]
        llm.pause("keep")
        llm.update_weights_from_disk(a)
        llm.resume()
        assert _gen(llm) == ref[a]
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer on another GPU")
def test_nccl_trainer_group(ckpt, ref):
    a, b = ckpt
    llm = LLM(a, max_model_len=256, gpu_memory_utilization=0.3)   # worker on cuda:0, trainer on cuda:1
    port = free_tcp_port()
    trainer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "_rl_trainer.py"), str(port), "2",
                                "nccl_group", b, "nccl", "cuda:1"], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, "nccl_group", "nccl")
        assert trainer.stdout.readline().strip() == "ready"
        new = load_file(os.path.join(b, "model.safetensors"))
        names = sorted(new)
        meta = {"names": names, "dtypes": ["bfloat16"] * len(names), "shapes": [list(new[n].shape) for n in names]}
        llm.pause("keep")
        trainer.stdin.write(json.dumps(meta) + "\n")
        trainer.stdin.flush()
        llm.update_weights_from_distributed(meta["names"], meta["dtypes"], meta["shapes"], "nccl_group")
        assert trainer.stdout.readline().strip() == "sent"
        llm.resume()
        assert _gen(llm) == ref[b]
        llm.destroy_weights_update_group("nccl_group")
        trainer.stdin.close()
        assert trainer.wait(60) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
        llm.shutdown()
