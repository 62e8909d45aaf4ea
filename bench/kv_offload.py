"""The CPU KV tier on one GPU (issue 50): TTFT of a long prompt re-hit from the CPU tier against
recomputing it, and throughput with the tier on at 0% hits against the tier off.

    python3 -m bench.kv_offload [--preset llama-3.1-8b] [--prompt-len 32768] [--offload-gb 64]

Multi-turn: 8 conversations re-sending their growing histories round-robin (up to --prompt-len
tokens each, the working set about 4x the GPU cache): p50 TTFT, tier on and off.

TTFT (the tier on): the GPU cache is held to a little over two long prompts, so prompt A, then two
other prompts of the same length, push A's blocks out of the GPU; A re-sent then loads them from
the CPU tier. Recompute: A's first send, in the same engine. One output token: its latency is the
TTFT. Throughput: random prompts that share nothing (0% hits) while the GPU cache evicts (so the
tier stores), tier on and off, the same GPU cache size."""
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


def run(path: str, prompt_len: int, gpu_blocks: int, offload_gb: float | None, n: int) -> dict:
    """One engine: (with the tier) TTFT of a fresh long prompt (recompute) and of the same prompt
    re-hit after two others pushed it out of the GPU cache; then 0%-hit throughput (random
    1,024/128 prompts, the GPU cache evicting throughout)."""
    from frontend import SamplingParams
    rng = random.Random(0)
    longs = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(4)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {}
    with _llm(path, offload_gb, max_model_len=max(prompt_len, 1024) + 144, num_gpu_blocks_override=gpu_blocks) as llm:
        cached = []   # each timed prompt's num_cached_tokens

        def timed(p):
            t0 = time.perf_counter()
            cached.append(llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)[0].num_cached_tokens)
            return time.perf_counter() - t0
        timed(longs[3][:1024])   # warm-up
        if offload_gb:
            out["ttft_recompute_s"] = timed(longs[0])
            timed(longs[1])
            timed(longs[2])
            out["ttft_cpu_tier_s"] = timed(longs[0])
            out["rehit_cached_tokens"] = cached[-1]   # all but the last block's: prompt_len - 16
        out["multi_turn"] = multi_turn(llm, gpu_blocks * 16, prompt_len, rng)
        prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(1024)]} for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        llm.generate(prompts[:8], params, use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        out["tok_per_s"] = n * (1024 + 128) / (time.perf_counter() - t0)
    return out


def multi_turn(llm, gpu_tokens: int, max_prompt: int, rng: random.Random, convs: int = 8, turns: int = 5) -> dict:
    """Agents re-sending their history: `convs` conversations taking turns round-robin, each turn the
    whole history plus new tokens (the previous reply and a new message; the first turn 3/8 of
    max_prompt, the last max_prompt); the working set (every conversation's last prompt) is about 4x
    the GPU cache. TTFT of each turn after the first (the first is cold with or without the tier); p50."""
    from frontend import SamplingParams
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = max_prompt - (turns - 1) * (max_prompt * 5 // 32)
    step = (max_prompt - first) // (turns - 1)
    history = [[] for _ in range(convs)]
    ttfts = []
    for turn in range(turns):
        for c in range(convs):
            grow = first if turn == 0 else step
            history[c] += [rng.randrange(100, 30000) for _ in range(grow)]
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": history[c]}], one, use_tqdm=False)
            if turn:
                ttfts.append(time.perf_counter() - t0)
    ttfts.sort()
    return {"p50_ttft_s": ttfts[len(ttfts) // 2], "requests": len(ttfts),
            "working_set_x_gpu": convs * len(history[0]) / gpu_tokens}


def copy_times(path: str, prompt_len: int, gpu_blocks: int) -> dict:
    """The tier's copies of the TTFT re-hit alone, at the model's KV shapes (GPU only): the re-hit's
    step stores the blocks it evicts (another prompt's tail, slots going up) and loads the prompt's
    blocks (its slots going down along it, as it was evicted tail first) into those same blocks.
    Host ms launching them and ms until done, stores alone, loads alone, and both (on two streams, the
    loads a chunk behind the stores: about the larger of the two, if the link's directions overlap)."""
    import torch

    from bench.common import read_model_config
    from ipc.messages import KVTransfers
    from workers.kv_offload import HostKVTier
    hf = read_model_config(path)
    heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    device = "cuda" if torch.cuda.is_available() else "cpu"   # (CPU: a smoke run)
    kv = [tuple(torch.zeros((gpu_blocks, 16, heads, head_dim), dtype=torch.bfloat16, device=device) for _ in "kv")
          for _ in range(hf["num_hidden_layers"])]
    n = prompt_len // 16 - 64
    tier = HostKVTier(2 * n, kv)
    taken = list(range(gpu_blocks - 1, gpu_blocks - 1 - n, -1))
    cases = {"stores": KVTransfers(taken, list(range(n, 2 * n)), [], []),
             "loads": KVTransfers([], [], list(range(n - 1, -1, -1)), taken)}
    cases["both"] = KVTransfers(taken, list(range(n, 2 * n)), list(range(n - 1, -1, -1)), taken)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {"blocks": n, "gib_each_way": n * tier.nbytes() / tier.num_slots / 2 ** 30}
    for name, xfer in [*cases.items(), *cases.items()]:   # (the second round is timed)
        sync()
        copies, t0 = tier.num_host_copies, time.perf_counter()
        tier.apply(xfer, kv)
        launched = time.perf_counter()
        tier.wait_forward()
        sync()
        out[name] = {"host_ms": (launched - t0) * 1e3, "done_ms": (time.perf_counter() - t0) * 1e3,
                     "host_copies": tier.num_host_copies - copies}
    return out


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
    gpu_blocks = (2 * args.prompt_len) // block + 64   # two long prompts fit, a third evicts the first
    with model_dir(args) as path:
        on = run(path, args.prompt_len, gpu_blocks, args.offload_gb, args.num_prompts)
        print("tier on", on, flush=True)
        off = run(path, args.prompt_len, gpu_blocks, None, args.num_prompts)
        print("tier off", off, flush=True)
        on["copies"] = copy_times(path, args.prompt_len, gpu_blocks)   # (last: its memory is this process's)
        print("the re-hit's tier copies alone", on["copies"], flush=True)
    rows = {"on": on, "off": off}
    print(f"\n{'kv-offload (' + args.preset + ', dummy)':<44} {'measured':>12} {'target':>14}")
    print(f"{f'TTFT {args.prompt_len} tokens, recompute s':<44} {on['ttft_recompute_s']:>12.3f} {'':>14}")
    print(f"{f'TTFT {args.prompt_len} tokens, CPU tier hit s':<44} {on['ttft_cpu_tier_s']:>12.3f} {'<= 0.25':>14}")
    print(f"{'  re-hit tokens computed (not cached)':<44} {args.prompt_len - on['rehit_cached_tokens']:>12} {'16':>14}")
    for name in ("stores", "loads", "both"):
        c = on["copies"][name]
        print(f"{f'  re-hit tier copies, {name}: host / done ms':<44} {c['host_ms']:>5.1f} / {c['done_ms']:>5.1f}"
              f" ({c['host_copies']} copies)")
    mt_on, mt_off = on["multi_turn"], off["multi_turn"]
    print(f"{'multi-turn working set / GPU cache':<44} {mt_on['working_set_x_gpu']:>12.2f} {'~4':>14}")
    print(f"{'multi-turn p50 TTFT, GPU-only s':<44} {mt_off['p50_ttft_s']:>12.3f} {'':>14}")
    print(f"{'multi-turn p50 TTFT, CPU tier s':<44} {mt_on['p50_ttft_s']:>12.3f} {'':>14}")
    print(f"{'multi-turn p50 TTFT, GPU-only / CPU tier':<44} {mt_off['p50_ttft_s'] / mt_on['p50_ttft_s']:>12.2f} "
          f"{'>= 3':>14}")
    ratio = on["tok_per_s"] / off["tok_per_s"]
    print(f"{'0%-hit throughput, tier on / off':<44} {ratio:>12.3f} {'>= 0.99':>14}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
