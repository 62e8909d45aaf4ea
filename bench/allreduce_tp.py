"""All-reduce latency on two GPUs, the numbers behind workers/distributed.py's one-shot threshold:

    python -m bench.allreduce_tp [--sizes-kb 8 64 512 2048]

For each bf16 size: NCCL eager and captured in a CUDA graph, and the symmetric-memory one-shot
and two-shot all-reduces (SymmMemAllReduce) graphed, in us per call (median of 5 rounds of 50),
and whether each symmetric-memory sum is exact. Serving uses one-shot up to
LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES and two-shot up to LOOM_TWO_SHOT_ALLREDUCE_MAX_BYTES, NCCL above;
this table says where each stops winning.

--norm-hidden H ... also times the all-reduce + residual add + RMSNorm of decode-sized rows:
the one-shot sum then the add-norm kernel, against the fused kernels (kernels/allreduce_norm.py:
the flagged pull, and the Lamport push at every row count), graphed, and checks that all give the
same bits.
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


def _norm_rows(symm, rank: int, device, hiddens: list[int], row_counts: list[int],
               variants: list[tuple[int, int]]) -> list[dict]:
    """us per all-reduce + add + RMSNorm, unfused and fused (per variant: programs, warps;
    0 = the default), at each row count."""
    import torch
    from kernels.rms_norm import fused_add_rms_norm
    rows_out = []
    for h in hiddens:
        for rows in row_counts:
            numel = rows * h
            if not symm.can_fuse_norm(rows, h, torch.bfloat16):
                continue
            gen = torch.Generator(device=device).manual_seed(rank)
            part = torch.randn(numel, generator=gen, device=device).to(torch.bfloat16)
            res = torch.randn(rows, h, device=device, generator=torch.Generator(device=device).manual_seed(9),
                              dtype=torch.float32).to(torch.bfloat16)
            w = torch.rand(h, device=device, generator=torch.Generator(device=device).manual_seed(7)).to(torch.bfloat16)
            summed = torch.empty(rows, h, dtype=torch.bfloat16, device=device)

            def unfused():
                for _ in range(2):
                    symm.reduce_buffer(numel, "one_shot", summed.view(-1))
                    fused_add_rms_norm(summed, res, w, 1e-5)

            symm.buffer_for(numel).copy_(part)
            for slot in (0, 1):
                symm.fused_buffer(slot, numel).copy_(part)
            symm.reduce_buffer(numel, "one_shot", summed.view(-1))
            want = fused_add_rms_norm(summed, res, w, 1e-5)
            row = {"hidden": h, "rows": rows, "unfused": _time(unfused, True) / 2, "fused": {}}
            f = symm.fused
            if rows <= f.lamport_rows:
                def lamport():
                    return [f.lamport_kernel(symm.fused_buffer(slot, numel).view(rows, h), f.inbox_ptrs[slot],
                                             f.inbox_stride, f.rank, res, w, 1e-5) for slot in (0, 1)]
                got = lamport()
                torch.cuda.synchronize()
                exact = all(torch.equal(a, b) for a, b in zip(want + want, got[0] + got[1]))
                row["lamport"] = (_time(lamport, True) / 2, exact)
            for programs, warps in variants:
                def fused(programs=programs, warps=warps):
                    return [f.kernel(f.buf_ptrs[slot], f.flag_ptrs, f.rank, rows, res, w, 1e-5,
                                     programs=programs or None, num_warps=warps or None) for slot in (0, 1)]
                got = fused()
                torch.cuda.synchronize()
                exact = all(torch.equal(a, b) for a, b in zip(want + want, got[0] + got[1]))
                row["fused"][(programs, warps)] = (_time(fused, True) / 2, exact)
            rows_out.append(row)
    return rows_out


def _rank(rank: int, port: int, sizes_kb: list[int], out, norm_hidden: list[int], norm_rows: list[int],
          variants: list[tuple[int, int]]) -> None:
    # a buffer for the largest size and norm shape (bf16), so both symmetric-memory paths are
    # timed at every size and the unfused norm rows can stage their parts in it
    largest = max(max(sizes_kb) * 1024, 2 * max(norm_hidden, default=0) * max(norm_rows, default=0))
    os.environ["LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES"] = str(largest)
    os.environ["LOOM_TWO_SHOT_ALLREDUCE_MAX_BYTES"] = str(largest)
    os.environ["LOOM_LAMPORT_ALLREDUCE_MAX_ROWS"] = str(max(norm_rows, default=0))  # timed at every row count
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
    norm_table = (_norm_rows(symm, rank, device, norm_hidden, norm_rows, variants)
                  if symm is not None and symm.fused else [])
    if rank == 0:
        out.put((rows, norm_table, distributed.describe()))
    dist.barrier()
    distributed.destroy_distributed()


def main() -> int:
    import torch.multiprocessing as mp
    from ipc.sockets import free_tcp_port
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kb", type=int, nargs="+",
                   default=[8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
                   help="all-reduce sizes in KiB (default 8 to 16384)")
    p.add_argument("--norm-hidden", type=int, nargs="*", default=[],
                   help="also time all-reduce + add + RMSNorm, unfused vs fused, at these hidden sizes")
    p.add_argument("--norm-rows", type=int, nargs="+", default=[1, 8, 64],
                   help="the row counts of --norm-hidden (default 1 8 64)")
    p.add_argument("--norm-variants", nargs="+", default=["0x0"],
                   help="fused kernel launches to compare, PROGRAMSxWARPS (0: the default, one program "
                        "per SM and warps by the row's length), e.g. 0x0 100000x0 (a program per row) 0x8")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_tcp_port()
    variants = [tuple(int(v) for v in spec.split("x")) for spec in args.norm_variants]
    assert all(len(v) == 2 for v in variants), "--norm-variants takes PROGRAMSxWARPS"
    procs = [ctx.Process(target=_rank, args=(r, port, args.sizes_kb, out, args.norm_hidden, args.norm_rows, variants))
             for r in range(2)]
    for proc in procs:
        proc.start()
    rows, norm_rows, info = out.get(timeout=600)
    for proc in procs:
        proc.join(60)
    print("us per all-reduce of bf16 on 2 GPUs (graph: replays of a captured CUDA graph)")
    print(f"{'KiB':>6} {'NCCL eager':>11} {'NCCL graph':>11} {'1shot graph':>12} {'2shot graph':>12} exact")
    for r in rows:
        f = lambda k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
        print(f"{r['kb']:>6} {f('nccl_eager'):>11} {f('nccl_graph'):>11} {f('one_shot'):>12} "
              f"{f('two_shot'):>12} {r.get('exact', '-')}")
    if args.norm_hidden:
        print(f"\nall-reduce + add + RMSNorm, us per call (graphed); rank 0: {info}")
        names = [f"{p or 'def'}x{w or 'def'}" for p, w in variants]
        print(f"{'hidden':>7} {'rows':>5} {'1shot+norm':>11} {'lamport':>8} " + " ".join(f"{n:>12}" for n in names)
              + "  same bits")
        for r in norm_rows:
            cells = [r["fused"][v] for v in variants]
            lamport_us, lamport_exact = r.get("lamport", (None, True))
            lamport = "-" if lamport_us is None else f"{lamport_us:.1f}"
            print(f"{r['hidden']:>7} {r['rows']:>5} {r['unfused']:>11.1f} {lamport:>8} "
                  + " ".join(f"{t:>12.1f}" for t, _ in cells) + f"  {lamport_exact and all(e for _, e in cells)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
