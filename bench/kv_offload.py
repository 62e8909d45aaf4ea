"""The CPU KV tier on one GPU (issue 50): TTFT of a long prompt re-hit from the CPU tier against
recomputing it, and throughput with the tier on at 0% hits against the tier off.

    python3 -m bench.kv_offload [--preset llama-3.1-8b] [--prompt-len 32768] [--offload-gb 64]

TTFT: the GPU cache is held to --gpu-blocks blocks (a little over two long prompts), so prompt A,
then two other prompts of the same length, push A's blocks out of the GPU; A re-sent then loads
them from the CPU tier (or, tier off, recomputes them). One output token: its latency is the TTFT.
Throughput: random prompts that share nothing (0% hits) while the cache evicts, tier on and off."""
from __future__ import annotations

import argparse
import json
import random
import time

from bench.common import model_dir


def _llm(path: str, offload_gb: float | None, **kw):
    from frontend import LLM
    opts = dict(load_format="dummy", max_model_len=kw.pop("max_model_len"), enable_prefix_caching=True, **kw)
    if offload_gb:
        opts["kv_offloading_size"] = offload_gb
    return LLM(path, **opts)


def ttft(path: str, prompt_len: int, gpu_blocks: int, offload_gb: float | None) -> dict:
    from frontend import SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(3)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with _llm(path, offload_gb, max_model_len=prompt_len + 16, num_gpu_blocks_override=gpu_blocks,
              max_num_seqs=1) as llm:
        llm.generate([{"prompt_token_ids": prompts[0][:512]}], one, use_tqdm=False)   # warm-up
        times = []
        for p in [prompts[0], prompts[1], prompts[2], prompts[0]]:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
    return {"first_s": times[0], "rehit_s": times[-1]}


def throughput(path: str, n: int, input_len: int, output_len: int, gpu_blocks: int, offload_gb: float | None) -> float:
    from frontend import SamplingParams
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(input_len)]} for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with _llm(path, offload_gb, max_model_len=input_len + output_len, num_gpu_blocks_override=gpu_blocks) as llm:
        llm.generate(prompts[:8], params, use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return n * (input_len + output_len) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--offload-gb", type=float, default=64.0)
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--output-json")
    args = p.parse_args()
    args.model = None
    block = 16
    rows = {}
    with model_dir(args) as path:
        gpu_blocks = (2 * args.prompt_len) // block + 64   # A and one more fit, the third evicts A
        for name, gb in (("recompute", None), ("cpu_tier", args.offload_gb)):
            rows[f"ttft_{name}"] = ttft(path, args.prompt_len, gpu_blocks, gb)
            print(name, rows[f"ttft_{name}"], flush=True)
        # 0% hits with evictions: a cache of ~1/4 of the workload's blocks
        tput_blocks = args.num_prompts * (1024 + 128) // block // 4
        for name, gb in (("off", None), ("on", args.offload_gb)):
            rows[f"tput_{name}"] = throughput(path, args.num_prompts, 1024, 128, tput_blocks, gb)
            print(name, rows[f"tput_{name}"], flush=True)
    print(f"\n{'kv-offload (' + args.preset + ', dummy)':<44} {'measured':>12} {'target':>14}")
    print(f"{f'TTFT {args.prompt_len} tokens, recompute s':<44} {rows['ttft_recompute']['rehit_s']:>12.3f} {'':>14}")
    print(f"{f'TTFT {args.prompt_len} tokens, CPU tier hit s':<44} {rows['ttft_cpu_tier']['rehit_s']:>12.3f} {'<= 0.25':>14}")
    ratio = rows["tput_on"] / rows["tput_off"]
    print(f"{'0%-hit throughput, tier on / off':<44} {ratio:>12.3f} {'>= 0.99':>14}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
