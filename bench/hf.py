"""`loom bench hf`: the same-run baseline, Hugging Face transformers `generate`.

Random weights (speed does not depend on them), bf16 on a GPU (fp32 on CPU),
sdpa attention, fixed shapes: a batch of random token-id prompts of
--input-len, each running exactly --output-len new tokens
(min_new_tokens = max_new_tokens). Prints output tok/s. The reference shapes
of docs/performance.md are batch 256 with 512 in / 256 out and batch 1 with
128 in / 128 out (--standard runs both).
"""
from __future__ import annotations

import argparse
import time

from bench import common
from bench.workloads import MAX_TOKEN_ID

STANDARD_SHAPES = [(256, 512, 256), (1, 128, 128)]


def add_parser(sub) -> None:
    p = sub.add_parser("hf", help="baseline: HF transformers generate on the same shapes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--batch-size", type=int, default=256, help="sequences generated together")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per sequence")
    p.add_argument("--standard", action="store_true",
                   help="run both reference shapes: 256 x 512/256 and 1 x 128/128 (ignores the three above)")
    p.add_argument("--iters", type=int, default=1, help="timed runs per shape (the median is reported)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="auto: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    p.add_argument("--output-json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=main)


def _device(device: str) -> str:
    import torch
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _dtype(dtype: str, device: str):
    import torch
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def load_hf_model(model_dir: str, dtype, device: str, seed: int = 0):
    """The transformers model of model_dir's config.json with random weights, sdpa attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:   # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate_bench(model_dir: str, batch_size: int, input_len: int, output_len: int, *,
                      dtype: str = "auto", device: str = "auto", seed: int = 0, temperature: float = 0.6,
                      iters: int = 1, model=None, shapes: list[tuple[int, int, int]] | None = None):
    """Time model.generate on a fixed shape; returns a dict (a list of dicts when `shapes` is given)."""
    import torch
    from transformers import GenerationConfig
    device = _device(device)
    tdtype = _dtype(dtype, device)
    own_model = model is None
    if own_model:
        t0 = time.perf_counter()
        model = load_hf_model(model_dir, tdtype, device, seed)
        print(f"HF model built in {time.perf_counter() - t0:.1f} s on {device} ({tdtype})", flush=True)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else 0
    eos_ids = eos if isinstance(eos, list) else [eos]
    high = min(cfg.vocab_size, MAX_TOKEN_ID + 1)
    results = []
    try:
        for b, n_in, n_out in shapes or [(batch_size, input_len, output_len)]:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            ids = torch.randint(0, high, (b, n_in), generator=gen).to(device)
            mask = torch.ones_like(ids)

            def run(new_tokens: int):
                gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                                      top_k=0 if temperature > 0 else None, top_p=1.0 if temperature > 0 else None,
                                      pad_token_id=eos_ids[0], eos_token_id=eos_ids, use_cache=True)
                with torch.inference_mode():
                    return model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)

            run(min(n_out, 4))          # warm-up
            _sync(device)
            times = []
            for _ in range(max(iters, 1)):
                _sync(device)
                t0 = time.perf_counter()
                out = run(n_out)
                _sync(device)
                times.append(time.perf_counter() - t0)
                if tuple(out.shape) != (b, n_in + n_out):
                    raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}, expected {(b, n_in + n_out)}")
            elapsed = sorted(times)[len(times) // 2]
            res = {"batch_size": b, "input_len": n_in, "output_len": n_out, "elapsed_s": elapsed,
                   "times_s": times, "output_tok_per_s": b * n_out / elapsed,
                   "total_tok_per_s": b * (n_in + n_out) / elapsed, "ms_per_step": 1000 * elapsed / n_out,
                   "device": device, "dtype": str(tdtype).replace("torch.", ""), "temperature": temperature}
            print(f"HF generate batch {b}, {n_in} in / {n_out} out: {res['output_tok_per_s']:.2f} output tok/s, "
                  f"{res['ms_per_step']:.2f} ms/step ({elapsed:.2f} s)", flush=True)
            results.append(res)
            ids = mask = None   # free them before the next batch size
    finally:
        if own_model:
            del model
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return results if shapes is not None else results[0]


def main(args: argparse.Namespace) -> int:
    import transformers
    shapes = STANDARD_SHAPES if args.standard else [(args.batch_size, args.input_len, args.output_len)]
    with common.model_dir(args) as mdir:
        res = hf_generate_bench(mdir, 0, 0, 0, dtype=args.dtype, device=args.device, seed=args.seed,
                                temperature=args.temperature, iters=args.iters, shapes=shapes)
    out = {"model": common.model_label(args), "transformers": transformers.__version__, "runs": res,
           "env": common.environment()}
    for r in res:
        print(f"HF transformers generate, batch {r['batch_size']}, {r['input_len']} in / {r['output_len']} out: "
              f"{r['output_tok_per_s']:.2f} output tok/s")
    common.write_json(args.output_json, out)
    return 0
