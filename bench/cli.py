"""`loom bench throughput|latency|serve|hf|profile-step|step-host|preset`: see docs/performance.md for the workloads."""
from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    from bench import embed, hf, latency, profile_step, serve, step_host, throughput
    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, hf (baseline), profile-step, step-host, preset",
                       description=__doc__)
    bsub = p.add_subparsers(dest="bench_command", required=True)
    throughput.add_parser(bsub)
    latency.add_parser(bsub)
    serve.add_parser(bsub)
    embed.add_parser(bsub)
    hf.add_parser(bsub)
    profile_step.add_parser(bsub)
    step_host.add_parser(bsub)
    pre = bsub.add_parser("preset", help="write a preset model directory (config.json + tokenizer) "
                                         "for `loom serve DIR --load-format dummy`")
    pre.add_argument("name", choices=sorted(_preset_names()), help="the preset")
    pre.add_argument("dir", help="directory to write config.json and the tokenizer to")
    pre.set_defaults(func=_write_preset)


def _preset_names():
    from bench.presets import ASR_PRESETS, PRESETS
    return [*PRESETS, *ASR_PRESETS]


def _write_preset(args: argparse.Namespace) -> int:
    from bench.presets import write_preset
    write_preset(args.name, args.dir)
    print(f"wrote {args.name} to {args.dir}; serve it with: loom serve {args.dir} --load-format dummy")
    return 0
