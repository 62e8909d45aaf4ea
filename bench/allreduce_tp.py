"""All-reduce latency on two GPUs, the numbers behind workers/distributed.py's one-shot threshold:

    python -m bench.allreduce_tp [--sizes-kb 8 64 512 2048]

For each bf16 size: NCCL eager and captured in a CUDA graph, and the symmetric-memory one-shot
and two-shot all-reduces (SymmMemAllReduce) graphed, in us per call (median of 5 rounds of 50),
and whether each symmetric-memory sum is exact. Serving uses one-shot up to
LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES and two-shot up to LOOM_TWO_SHOT_ALLREDUCE_MAX_BYTES, NCCL above;
this table says where each stops winning.
"""
from __future__ import annotations

import argparse
import os
import statistics


def _time(fn, graphed: bool) -> float:
    import torch
    if graphed:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        stop.record()
        stop.synchronize()
        rounds.append(start.elapsed_time(stop) * 1000 / 50)
    return statistics.median(rounds)


def _rank(rank: int, port: int, sizes_kb: list[int], out) -> None:
    # a buffer for the largest size, so both symmetric-memory paths are timed at every size
    os.environ["LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES"] = str(max(sizes_kb) * 1024)
    os.environ["LOOM_TWO_SHOT_ALLREDUCE_MAX_BYTES"] = str(max(sizes_kb) * 1024)
    import torch
    import torch.distributed as dist
    from workers import distributed
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    store_host = "127.0.0.1"
    if rank == 0:
        store = distributed.serve_rendezvous(store_host, port)  # noqa: F841 (kept alive)
    distributed.init_distributed(rank, distributed.Rendezvous(store_host, port, 2), device, torch.bfloat16)
    symm = distributed._state.symm
    rows = []
    for kb in sizes_kb:
        x = torch.full((kb * 1024 // 2,), float(rank + 1), dtype=torch.bfloat16, device=device)
        row = {"kb": kb,
               "nccl_eager": _time(lambda: dist.all_reduce(x), False),
               "nccl_graph": _time(lambda: dist.all_reduce(x), True)}
        for method in ("one_shot", "two_shot") if symm is not None else ():
            row[method] = _time(lambda: symm(x, method), True)
            y = torch.full_like(x, float(rank + 1))
            symm(y, method)
            torch.cuda.synchronize()
            row["exact"] = row.get("exact", True) and bool((y == 3).all())
        rows.append(row)
    if rank == 0:
        out.put(rows)
    dist.barrier()
    distributed.destroy_distributed()


def main() -> int:
    import torch.multiprocessing as mp
    from ipc.sockets import free_tcp_port
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kb", type=int, nargs="+",
                   default=[8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_tcp_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.sizes_kb, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=300)
    for proc in procs:
        proc.join(60)
    print("us per all-reduce of bf16 on 2 GPUs (graph: replays of a captured CUDA graph)")
    print(f"{'KiB':>6} {'NCCL eager':>11} {'NCCL graph':>11} {'1shot graph':>12} {'2shot graph':>12} exact")
    for r in rows:
        f = lambda k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
        print(f"{r['kb']:>6} {f('nccl_eager'):>11} {f('nccl_graph'):>11} {f('one_shot'):>12} "
              f"{f('two_shot'):>12} {r.get('exact', '-')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
