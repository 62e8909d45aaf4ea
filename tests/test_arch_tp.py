"""Tensor parallelism on every native architecture: each `path == "loom"` entry of
tests/tiny_models.ARCHS, loaded sharded at TP=2 on two CPU processes in one gloo group, gives
HF transformers' logits (fp32) over a varlen prefill, decode steps and a chunked prefill
through the paged KV cache (tests/test_models.py's scenario), on rank 0 and, bit for bit, on rank 1.

The tiny models split: 4 query and 2 KV heads (one per rank), an intermediate size of 128, and a
vocabulary of 337 (padded to 338, the last rank's padding row unused). Extra cases replicate one
KV head on both ranks (with the row-parallel biases that must be added once) and tie the lm_head
to the embedding. Every norm weight and bias is random, so that a rank's share of them is tested.
The MoE architectures run again with --enable-expert-parallel (whole experts per rank, an uneven
split too), and with their experts updated by checkpoint name (a weight update) under TP and EP.
InternLM2 (remote code) runs on a Llama's weights, with HF Llama as the oracle, and each weight
quantization format on a Llama with biases, with HF on the dequantized weights as the oracle.

One pair of worker processes (tests/_tp_arch_worker.py) runs every case in turn, fed while the
next checkpoint is built; each parametrized test asserts its own case's result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, _ends_with_this_test_process
from tests.tiny_models import ARCHS, llama_to_internlm2, make_tiny_model

WORLD = 2
VOCAB = 337       # odd: the vocabulary is padded to split
DEADLINE_S = 300  # for all the cases together: a hung collective fails the tests, not the run

# name -> (ARCHS entry, config overrides on top of the entry's own); every native ARCHS entry as it is
CASES: dict[str, tuple[str, dict]] = {name: (name, {}) for name, a in sorted(ARCHS.items()) if a.path == "loom"}
CASES.update({
    # one KV head: replicated on both ranks; o_proj's and down_proj's biases are added once
    "llama-kv1-biases": ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
    # OLMo2's q/k norms span every head (the ranks add their sums of squares), with one KV head replicated
    "olmo2-kv1": ("olmo2", {"num_key_value_heads": 1}),
    # the lm_head is the (vocabulary-parallel) embedding
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    # --enable-expert-parallel: whole experts per rank (Qwen2-MoE's shared expert stays tensor-parallel)
    "qwen3_moe-ep": ("qwen3_moe", {}),
    "mixtral-ep": ("mixtral", {}),
    "qwen2_moe-ep": ("qwen2_moe", {}),
    "qwen3_moe-ep-uneven": ("qwen3_moe", {"num_experts": 5}),   # 3 experts on rank 0, 2 on rank 1
    # expert weights updated by their checkpoint names (experts.{e}.gate_proj...) land in the stacked ones
    "qwen3_moe-update-experts": ("qwen3_moe", {}),
    "qwen3_moe-ep-update-experts": ("qwen3_moe", {}),
    # InternLM2 (remote code: no HF class) on a Llama's weights, HF Llama the oracle: each rank
    # unpacks its own query heads from wqkv, and the one KV head replicated on both
    "internlm2-kv1": ("llama", {"num_key_value_heads": 1}),
})
# each weight-quantization format's checkpoint (tests/test_quantization.py writes them), HF on the
# dequantized dense twin the oracle: column-parallel layers split the packed weights' output rows,
# scales and zero points; row-parallel ones their input rows and groups
QUANT_FORMATS = ["ct-fp8-dynamic", "fp8-per-tensor", "fp8-block", "ct-w4a16-g32-asym", "gptq-g32-desc-act-asym",
                 "awq-g32"]
CASES.update({f"quant-{fmt}": ("llama", {"attention_bias": True}) for fmt in QUANT_FORMATS})
EXPERT_PARALLEL = {name for name in CASES if "-ep" in name}
UPDATED = {name for name in CASES if name.endswith("-update-experts")}   # loaded from another seed, then updated
AS_INTERNLM2 = {"internlm2-kv1"}   # the Llama checkpoint rewritten as InternLM2's (tests/tiny_models.llama_to_internlm2)


def build_checkpoint(out_dir: str, arch: str, overrides: dict, seed: int = 0) -> str:
    """make_tiny_model's checkpoint with every 1-D tensor (norm weights, biases) random too
    (HF initializes them to ones and zeros, where a wrong shard or a doubled bias would not show)."""
    from safetensors.torch import load_file, save_file
    make_tiny_model(out_dir, arch, seed=seed, vocab_size=VOCAB, **overrides)
    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if t.dim() == 1 and t.is_floating_point():
            if "norm" in name:
                t.uniform_(0.5, 1.5, generator=g)
            else:
                t.normal_(0.0, 0.1, generator=g)
    save_file(weights, path, metadata={"format": "pt"})
    return out_dir


def quantize(model_dir: str, out_dir: str, fmt: str) -> tuple[str, str]:
    """(the checkpoint in format fmt, its dequantized dense twin): tests/test_quantization.py's writer."""
    from pathlib import Path

    from tests.test_quantization import FORMATS, quantize_checkpoint
    write, quantization_config, _ = FORMATS[fmt]
    return quantize_checkpoint(model_dir, Path(out_dir), write, quantization_config)


def other_experts(model_dir: str, out_dir: str, seed: int = 1) -> str:
    """model_dir's checkpoint with other random expert weights: updating its experts to
    model_dir's must give model_dir's model."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if ".experts." in name:
            t.normal_(0.0, 0.2, generator=g)
    save_file(weights, path, metadata={"format": "pt"})
    return out_dir


class WorkerPair:
    """WORLD rank processes on a TCPStore of ours, each fed jobs on stdin, writing results to its file."""

    def __init__(self, tmp: str, attempt: int):
        from workers.distributed import serve_rendezvous
        self.store = serve_rendezvous("127.0.0.1", 0, timeout_s=120)
        self.results = [os.path.join(tmp, f"results-{attempt}-rank{r}.jsonl") for r in range(WORLD)]
        self.log = os.path.join(tmp, f"workers-{attempt}.log")
        # Not interpreted: the layers take their torch references on the CPU (the Triton kernels
        # are checked against them in tests/test_kernels.py), which keeps a case at ~0.1 s of CPU
        # (the interpreted vocab-parallel embedding alone tripled that).
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with open(self.log, "wb") as log:
            self.procs = [subprocess.Popen([sys.executable, "-m", "tests._tp_arch_worker", str(r), str(WORLD),
                                            str(self.store.port), self.results[r]],
                                           cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                           preexec_fn=_ends_with_this_test_process)
                          for r in range(WORLD)]

    def send(self, job: dict) -> None:
        line = (json.dumps(job) + "\n").encode()
        for p in self.procs:
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except BrokenPipeError:   # the rank has exited: what it wrote says why
                pass

    def finish(self, deadline: float) -> None:
        """Close the job streams, wait for the ranks until the deadline, then kill what is left."""
        for p in self.procs:
            try:
                p.stdin.close()
            except BrokenPipeError:
                pass
        try:
            for p in self.procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def reports(self) -> list[dict]:
        out = []
        for path in self.results:
            if os.path.exists(path):
                with open(path) as f:
                    out += [json.loads(line) for line in f if line.strip()]
        return out

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> dict[str, str | None]:
    """case -> None (passed at TP=2) or why it failed. A pair whose ranks raised (the group is then
    out of step) is replaced by a fresh one for the cases left."""
    tmp = str(tmp_path_factory.mktemp("arch-tp"))
    deadline = time.monotonic() + DEADLINE_S
    dirs: dict[str, str] = {}
    results: dict[str, str | None] = {}
    for attempt in range(len(CASES)):
        left = [name for name in CASES if name not in results]
        if not left or time.monotonic() > deadline:
            break
        pair = WorkerPair(tmp, attempt)
        try:
            for name in left:   # the ranks start up and run a case while the next checkpoint is built
                arch, overrides = CASES[name]
                if name not in dirs:
                    dirs[name] = build_checkpoint(os.path.join(tmp, name), arch, overrides)
                job = {"name": name, "model_dir": dirs[name], "expert_parallel": name in EXPERT_PARALLEL}
                if name.startswith("quant-"):
                    quantized = f"{name}-quantized"
                    if quantized not in dirs:
                        dirs[quantized], dirs[f"{name}-dense"] = quantize(dirs[name], os.path.join(tmp, quantized),
                                                                          name.removeprefix("quant-"))
                    job.update(model_dir=dirs[quantized], hf_dir=dirs[f"{name}-dense"])
                if name in AS_INTERNLM2:
                    converted = f"{name}-converted"
                    if converted not in dirs:
                        dirs[converted] = llama_to_internlm2(dirs[name], os.path.join(tmp, converted))
                    job.update(model_dir=dirs[converted], hf_dir=dirs[name])
                if name in UPDATED:
                    base = f"{name}-base"
                    if base not in dirs:
                        dirs[base] = other_experts(dirs[name], os.path.join(tmp, base))
                    job["base_dir"] = dirs[base]
                pair.send(job)
            pair.finish(deadline)
        finally:
            pair.kill()
        reports: dict[str, dict[int, str | None]] = {}
        for r in pair.reports():
            reports.setdefault(r["name"], {})[r["rank"]] = r["error"]
        if not reports:   # no progress at all: the pair never started, or hung on its first case
            for name in left:
                results[name] = f"no result from the TP=2 workers; their log:\n{pair.log_tail()}"
            break
        for name, by_rank in reports.items():
            errors = [f"rank {rank}: {error}" for rank, error in sorted(by_rank.items()) if error]
            if errors or 0 in by_rank:   # rank 0 compares with HF: no pass without its report
                results[name] = "\n".join(errors) or None
    for name in CASES:
        results.setdefault(name, "no result from the TP=2 workers (deadline passed)")
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_hf(tp_results, case):
    assert tp_results[case] is None, f"{case} at TP=2:\n{tp_results[case]}"
