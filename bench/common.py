"""Options and helpers shared by the offline benchmarks (throughput, latency, hf)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile

from bench.presets import PRESETS, write_preset
from ipc.config import ConfigError, EngineConfig

DEFAULT_MAX_MODEL_LEN = 4096
# EngineConfig fields that are not bench flags: filled by resolve(), or set by the bench itself
_SKIP = {"model", "model_max_len", "vocab_size", "eos_token_ids", "default_sampling_params", "seed"}


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (0 or less ran a whole engine start first, then failed)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number above 0 (inf allowed)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="a Hugging Face model directory")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="the real config of a known model with random weights (--load-format dummy)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every `loom serve` engine option (--max-num-seqs, --enforce-eager, --dtype, ...).
    --max-model-len defaults to min(4096, the model's limit); --load-format to dummy for presets."""
    from frontend.entrypoints.args import add_engine_args as add_flags
    g = p.add_argument_group("engine options (as for `loom serve`)")
    add_flags(g, defaults={"max_model_len": None, "load_format": None}, skip=_SKIP)


def read_model_config(model_dir: str) -> dict:
    from ipc.config import read_json_object
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--model {model_dir!r} has no config.json")
    hf = read_json_object(path)
    return hf.get("text_config", hf)


def engine_options(args: argparse.Namespace, model_dir: str) -> dict:
    """LLM(...) keyword options from the parsed flags."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - _SKIP
    opts = {n: getattr(args, n) for n in names if hasattr(args, n)}
    opts["seed"] = args.seed
    if opts.get("load_format") is None:
        opts["load_format"] = "dummy" if getattr(args, "preset", None) else "auto"
    if opts.get("max_model_len") is None:
        limit = int(read_model_config(model_dir).get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)
        opts["max_model_len"] = min(DEFAULT_MAX_MODEL_LEN, limit)
    return opts


@contextlib.contextmanager
def model_dir(args: argparse.Namespace):
    """The model directory to load: --model as given, or a temporary one for --preset. An
    --output-json that cannot be written fails here, before the run (not after it)."""
    out = getattr(args, "output_json", None)
    if out:
        d = os.path.dirname(os.path.abspath(out))
        while not os.path.isdir(d):   # write_json makes the missing directories
            d = os.path.dirname(d)
        if not os.access(d, os.W_OK):
            raise ConfigError(f"--output-json {out!r}: {d} is not writable")
    if not getattr(args, "preset", None):
        yield args.model
        return
    tmp = tempfile.mkdtemp(prefix=f"loom-bench-{args.preset}-")
    try:
        write_preset(args.preset, tmp)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_label(args: argparse.Namespace) -> str:
    return f"preset:{args.preset}" if getattr(args, "preset", None) else args.model


def write_json(path: str | None, result: dict) -> None:
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results written to {path}")


def environment() -> dict:
    """What the numbers were measured on."""
    import platform
    import torch
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                       text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["commit"] = None
    return env
