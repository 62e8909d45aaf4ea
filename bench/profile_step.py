"""`loom bench profile-step`: where one step's device time goes, per kernel.

Runs the model's forward (Triton kernels on CUDA, eager so that the profiler
sees each kernel) under torch.profiler and prints device time per kernel per
step beside the step's floor. Decode (default): --batch sequences with
--context tokens of KV each; floor = (weights + KV read) over 4.3 TB/s.
--prefill: --batch whole prompts of --context tokens each; floor = the
matmul FLOPs at 790 TFLOP/s.

    loom bench profile-step --preset qwen3-0.6b --batch 1 128 --context 1024
    loom bench profile-step --preset qwen3-0.6b --prefill --batch 8 --context 1024

--graph instead times CUDA-graph replays of the step (the gaps between kernels
included, as a served decode step runs), once per --pdl setting, alternating,
and checks that the settings give the same logits:

    loom bench profile-step --preset qwen3-0.6b --batch 1 --context 256 --graph --pdl off on

--query-len Q: each sequence has Q new tokens, with logits at every one (a speculative verify
step of Q - 1 drafts), once per value, so a verify step and a plain one print side by side:

    loom bench profile-step --preset qwen3-0.6b --batch 8 --context 256 --query-len 1 5

--lora-adapters N: every targetable linear gets N random rank --lora-rank adapters in GPU slots
(workers/lora), token t running adapter t % N (the LoRA kernels' per-step cost, issue 51):

    loom bench profile-step --preset llama-3.1-8b --batch 1 256 --lora-adapters 8
"""
from __future__ import annotations

import argparse

from bench import common

HBM_BYTES_PER_S = 4.3e12  # device-to-device copy rate measured on the H200 (docs/performance.md)
MATMUL_FLOPS = 790e12     # bf16 dense matmul rate measured on the H200


def add_parser(sub) -> None:
    p = sub.add_parser("profile-step", help="per-kernel device time of one decode step",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 128], help="decode batch size(s) to profile")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per sequence")
    p.add_argument("--prefill", action="store_true", help="whole prompts of --context tokens, not decodes")
    p.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="N random adapters on every targetable linear, token t on adapter t %% N")
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank (with --lora-adapters)")
    p.add_argument("--query-len", type=int, nargs="+", default=[1], metavar="Q",
                   help="decode: new tokens per sequence, each with logits (a verify step of Q - 1 drafts)")
    p.add_argument("--quantization", default=None,
                   help="--quantization of the dummy model (fp8, gptq, awq...; None: bf16)")
    p.add_argument("--iters", type=int, default=20, help="profiled steps per batch size")
    p.add_argument("--top", type=int, default=14, help="kernels to list per batch size")
    p.add_argument("--device", default="cuda", help="where the model runs: cuda, cuda:N or cpu")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="also: host time to launch one step (no sync) and the N functions that take it")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays of the step instead of profiling its kernels")
    p.add_argument("--pdl", nargs="+", choices=("on", "off"), default=["on"],
                   help="with --graph: programmatic dependent launch settings to capture and compare")
    p.add_argument("--rounds", type=int, default=10, help="with --graph: alternating rounds of --iters replays")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workers.attention import AttentionMetadata
    from workers.model_loader import load_model, model_kv_shape
    from workers.models.layers import use_triton_kernels

    device = torch.device(args.device)
    if args.graph and device.type != "cuda":
        raise SystemExit("--graph replays CUDA graphs: it needs --device cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "triton" if device.type == "cuda" else "torch"
    with common.model_dir(args) as mdir:
        model = load_model(mdir, dtype, device, "dummy" if args.preset else "auto",
                           quantization=args.quantization)
    if backend == "triton":
        use_triton_kernels()
    lora = _random_adapters(model, args, dtype, device, backend) if args.lora_adapters else None
    num_layers, kv_heads, head_dim = model_kv_shape(model.config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block = 16
    blocks_per_seq = -(-(args.context + 1) // block)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    cases = [(bs, 1) for bs in args.batch] if args.prefill else [(bs, q) for bs in args.batch for q in args.query_len]
    for bs, q in cases:
        num_blocks = bs * blocks_per_seq
        shape = (num_blocks, block, kv_heads, head_dim)
        caches = [(torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))
                  for _ in range(num_layers)]
        table = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(bs, blocks_per_seq)
        if args.prefill:  # q_len = seq_len = context: every token is new
            q_len, seq_len, positions = args.context, args.context, torch.arange(args.context, device=device)
        else:   # q new tokens after context - q + 1 cached ones: the sequence is context + 1 long
            q_len, seq_len = q, args.context + 1
            positions = torch.arange(seq_len - q, seq_len, device=device)
        seq_lens = torch.full((bs,), seq_len, dtype=torch.int32, device=device)
        pos = positions.repeat(bs)
        slots = (table.long().gather(1, (positions // block).repeat(bs, 1)) * block + positions % block).view(-1)
        qsl = torch.arange(bs + 1, dtype=torch.int32, device=device) * q_len
        meta = AttentionMetadata(qsl, seq_lens, table, slots, q_len, seq_len, backend,
                                 num_decodes=bs if q_len == 1 else 0)
        ids = torch.randint(0, model.config.vocab_size, (len(pos),), device=device)
        # the sampled rows: each prompt's last token; every query token of a verify step
        last = qsl[1:] - 1 if args.prefill else torch.arange(len(pos), device=device)
        if lora is not None:   # token t runs adapter t % N (the rest of the buffer: the base model)
            lora.token_slots.fill_(-1)
            lora.token_slots[:len(pos)] = torch.arange(len(pos), device=device) % args.lora_adapters
        title = (f"prefill batch {bs}, context {args.context}" if args.prefill else
                 f"decode batch {bs}, context {args.context}" + (f", {q} tokens each" if q > 1 else ""))
        if lora is not None:
            title += f", {args.lora_adapters} adapters of rank {args.lora_rank}"

        def step():
            with torch.inference_mode():
                hidden = model(ids, pos, caches, meta)
                return model.compute_logits(hidden[last])

        if args.graph:
            _time_graphs(step, args, title)
            caches = None
            continue
        for _ in range(3):  # compiles and warms up outside the profile
            step()
        sync()
        with profile(activities=activities) as prof:
            for _ in range(args.iters):
                step()
            sync()
        kv_bytes = 2 * num_layers * bs * seq_len * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        if args.prefill:  # matmuls over every token (the lm_head over one per sequence)
            layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
            embed = model.config.vocab_size * model.config.hidden_size
            floor_ms = 1e3 * 2 * (len(pos) * layer_params + bs * embed) / MATMUL_FLOPS
            floor = f"{floor_ms:.3f} ms: matmuls at {MATMUL_FLOPS / 1e12:.0f} TFLOP/s"
        else:
            floor_ms = 1e3 * (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
            floor = (f"{floor_ms:.3f} ms: weights {weight_bytes / 2**30:.2f} GiB + KV {kv_bytes / 2**30:.2f} GiB "
                     f"at {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
        _report(prof, title, args, floor)
        if args.host:
            _report_host(step, sync, args)
        caches = None  # free this batch size's KV before the next one
    return 0


def _random_adapters(model, args, dtype, device, backend):
    """--lora-adapters: a LoRALinear on every targetable linear (workers/lora/manager.py's), its
    slots filled with random adapters (A and B ~ N(0, 0.01^2)); returns the context whose
    token_slots each step sets."""

    from workers.lora.layers import LoRAContext
    from workers.lora.manager import _attach
    max_tokens = max(args.batch) * (args.context if args.prefill else max(args.query_len))
    ctx = LoRAContext(max_tokens, device, use_triton=backend == "triton")
    linears = _attach(model, ctx, args.lora_adapters, args.lora_rank, dtype, device)
    if not linears:
        raise SystemExit(f"--lora-adapters: {type(model).__name__} has no linear adapters can target")
    for lin in linears.values():
        lin.a.normal_(0, 0.01)
        lin.b.normal_(0, 0.01)
    return ctx


def _time_graphs(step, args, title: str) -> None:
    """Capture the step once per --pdl setting; replay the graphs in alternating rounds of
    --iters; print each one's median and best ms per step, and whether the logits agree."""
    import statistics

    import torch

    from kernels import jit
    graphs, logits = {}, {}
    setting = jit.set_pdl(True)
    for mode in args.pdl:
        jit.set_pdl(mode == "on")
        for _ in range(3):  # compiles this setting's kernel variants outside the capture
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits[mode] = step()
        graphs[mode] = graph
    jit.set_pdl(setting)
    times = {mode: [] for mode in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for mode, graph in graphs.items():
            start.record()
            for _ in range(args.iters):
                graph.replay()
            end.record()
            end.synchronize()
            times[mode].append(start.elapsed_time(end) / args.iters)
    print(f"\n{title}: CUDA graph, ms per step over {args.rounds} rounds of {args.iters} replays")
    for mode, t in times.items():
        print(f"  pdl {mode:3s}: median {statistics.median(t):.4f}  best {min(t):.4f}")
    first = next(iter(logits.values()))
    for mode, out in logits.items():
        print(f"  pdl {mode:3s}: logits equal to pdl {args.pdl[0]}'s: {torch.equal(out, first)}")


def _report_host(step, sync, args) -> None:
    """The model forward's launch cost on the host: what an eager step costs when the
    device is faster than Python."""
    import cProfile
    import pstats
    import time
    sync()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    host_ms = 1e3 * (time.perf_counter() - t0) / args.iters
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        step()
    prof.disable()
    sync()
    print(f"host: {host_ms:.3f} ms to launch one step; by own time (cProfile, {args.iters} steps):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.host)


def _report(prof, title: str, args, floor: str) -> None:
    from torch.autograd import DeviceType
    rows = []
    cuda = args.device.startswith("cuda")
    for e in prof.key_averages():
        if cuda:  # kernels only (CPU ops also carry their children's device time)
            if e.device_type != DeviceType.CUDA:
                continue
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        else:
            t = e.self_cpu_time_total
        if t:
            rows.append((t / args.iters / 1e3, e.count // args.iters, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    print(f"\n{title}: {total:.3f} ms of kernels per step in {launches} launches (floor {floor})")
    print(f"{'ms/step':>9} {'calls':>6}  kernel")
    for t, n, name in rows[:args.top]:
        print(f"{t:9.4f} {n:6d}  {name[:110]}")
