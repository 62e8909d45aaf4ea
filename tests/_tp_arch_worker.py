"""One rank of tests/test_arch_tp.py's gloo pair: every native architecture at TP=2 on the CPU.

    python -m tests._tp_arch_worker RANK WORLD_SIZE STORE_PORT RESULTS_FILE

It joins the group as the workers do (workers/distributed.init_distributed, on the test's
TCPStore), then for each line on stdin (JSON {"name", "model_dir", optional "expert_parallel":
MoE experts placed whole on ranks, and "base_dir": load that checkpoint, then update the experts
to model_dir's by name}) loads the model sharded (workers/model_loader.load_model under the
group) and runs tests/test_models.py's
scenario: a varlen prefill, decode steps and a chunked prefill over a NaN-filled paged KV cache.
Every rank runs the same steps (the collectives pair up); rank 0 then compares its logits
with HF transformers' on the same checkpoint (fp32), and every other rank checks that it got
rank 0's logits bit for bit. One JSON line per architecture goes to RESULTS_FILE: {"name", "rank", "error"}
(error None: passed). An exception leaves the group out of step: the rank writes it and exits 1,
and the test starts a fresh pair for the architectures left.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

from tests.test_models import ATOL, hf_logits, scenario_logits
from workers import distributed
from workers.model_loader import load_model
from workers.models.moe import FusedMoE


def first_mismatch(outs: list, model_dir: str) -> str | None:
    """The first output whose logits differ from HF's (None: all equal within ATOL). HF runs
    once per sequence: a causal model's logits of a prefix are the first rows of the whole's."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    refs: dict[tuple[int, ...], torch.Tensor] = {}
    for tokens in sorted({tuple(t) for _, t, _ in outs}, key=len, reverse=True):
        if not any(seq[:len(tokens)] == tokens for seq in refs):
            refs[tokens] = hf_logits(hf, list(tokens))
    for i, (out, tokens, rows) in enumerate(outs):
        whole = next(logits for seq, logits in refs.items() if seq[:len(tokens)] == tuple(tokens))
        try:
            torch.testing.assert_close(out, whole[:len(tokens)][rows], atol=ATOL, rtol=0)
        except AssertionError as e:
            return f"logits of output {i} ({len(tokens)} tokens, rows {rows}) differ from HF's: {e}"
    return None


def update_experts(model, job: dict) -> str | None:
    """The job's weight update: every expert tensor of model_dir (checkpoint names, partial load,
    as workers/weight_update.py loads them) onto a model loaded from base_dir; then each expert
    tensor read back by name (get_weights_by_name on every rank, merged) equals model_dir's."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from ipc.config import EngineConfig
    from ipc.control import merge_weight_rows
    from workers.weight_update import WeightUpdater
    new = {n: t for n, t in load_file(f"{job['model_dir']}/model.safetensors").items() if ".experts." in n}
    runner = SimpleNamespace(model=model, device=torch.device("cpu"), weights_dir=job["base_dir"],
                             config=EngineConfig(model=job["base_dir"]))
    updater = WeightUpdater(runner, distributed.tp_rank())
    updater.check((n, t.shape, t.dtype) for n, t in new.items())
    with torch.inference_mode():
        loaded = model.load_weights(new.items(), partial=True)
    if loaded != set(new):
        return f"the update loaded {len(loaded)} of {len(new)} expert tensors"
    for name in sorted(new)[:3] + sorted(new)[-3:]:   # gate, up, down of the first and the last expert
        for n in (3, 1000):
            parts = [None] * distributed.tp_size()
            dist.all_gather_object(parts, updater.get_weights_by_name(name, n))
            if not torch.equal(torch.tensor(merge_weight_rows(parts))[:n], new[name][:n]):
                return f"{name} (first {n} rows) does not read back as sent"
    return None


def run_arch(job: dict, rank: int) -> str | None:
    distributed.set_expert_parallel(job.get("expert_parallel", False))
    try:
        model = load_model(job.get("base_dir") or job["model_dir"], torch.float32, "cpu")
    finally:
        distributed.set_expert_parallel(False)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if job.get("expert_parallel") and not all(0 < m.w13_weight.shape[0] < m.num_experts for m in moes):
        return f"rank {rank} holds {[m.w13_weight.shape[0] for m in moes]} experts per layer: expected a part"
    if job.get("base_dir"):
        error = update_experts(model, job)
        if error:
            return error
    outs = list(scenario_logits(model))
    # every rank holds the whole logits (the lm_head's parts gathered): rank 0's go to the others
    flat = torch.cat([out.reshape(-1) for out, _, _ in outs])
    theirs = flat.clone()
    dist.broadcast(theirs, src=0)
    if rank != 0:
        return None if torch.equal(flat, theirs) else f"rank {rank}'s logits differ from rank 0's"
    try:   # no collective past this point: an error here leaves the group in step
        return first_mismatch(outs, job.get("hf_dir") or job["model_dir"])   # hf_dir: a quantized model's dense twin
    except Exception:
        return f"the HF comparison raised:\n{traceback.format_exc()}"


def main() -> None:
    rank, world, port, results = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    distributed.init_distributed(rank, distributed.Rendezvous("127.0.0.1", port, world), torch.device("cpu"),
                                 torch.float32, timeout_s=120)
    with open(results, "a") as out:
        def report(name: str, error: str | None) -> None:
            out.write(json.dumps({"name": name, "rank": rank, "error": error}) + "\n")
            out.flush()

        for line in sys.stdin:
            job, start = json.loads(line), time.perf_counter()
            try:
                error = run_arch(job, rank)
            except BaseException:
                report(job["name"], traceback.format_exc())
                sys.exit(1)
            report(job["name"], error)
            print(f"rank {rank}: {job['name']} in {time.perf_counter() - start:.2f} s (cpu {time.process_time():.2f} s)", file=sys.stderr, flush=True)
    distributed.destroy_distributed()


if __name__ == "__main__":
    main()
