"""The `loom` command line: every flag documented (help, default shown, choices where they apply);
configuration mistakes are one line on stderr and exit status 2, with no traceback."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from frontend.entrypoints import cli
from tests.conftest import ROOT, popen_serve


def _parsers(parser: argparse.ArgumentParser, name: str = "loom"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _root_parser() -> argparse.ArgumentParser:
    built = {}

    class _Stop(Exception):
        pass

    def capture(self, *args, **kwargs):
        built["parser"] = self
        raise _Stop

    orig = cli.LoomParser.parse_args
    cli.LoomParser.parse_args = capture
    try:
        cli.main([])
    except _Stop:
        pass
    finally:
        cli.LoomParser.parse_args = orig
    return built["parser"]


def test_every_flag_has_help_and_shows_its_default():
    names, missing = [], []
    for name, parser in _parsers(_root_parser()):
        names.append(name)
        fmt = parser._get_formatter()
        for a in parser._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not a.help or not a.help.replace("(default: %(default)s)", "").strip():
                missing.append(f"{name} {a.option_strings or a.dest}: no help")
            elif a.option_strings and "%(default)" not in fmt._get_help_string(a):
                missing.append(f"{name} {a.option_strings}: default not shown")
    assert {"loom serve", "loom demo-model", "loom bench throughput", "loom bench serve"} <= set(names), names
    assert not missing, "\n".join(missing)
    serve = dict(_parsers(_root_parser()))["loom serve"]
    choices = {a.dest: a.choices for a in serve._actions}
    assert set(choices["dtype"]) >= {"auto", "bfloat16", "float16", "float32"} and choices["device"]


def _loom(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_mistyped_dtype_is_one_line(tiny_model_dir):
    line = _one_line(_loom("serve", tiny_model_dir, "--dtype", "bfloat61"))
    assert "--dtype" in line and "bfloat61" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line(tiny_model_dir):
    line = _one_line(_loom("serve", tiny_model_dir, "--device", "cuda"))
    assert "--device cuda" in line and "GPU" in line
    line = _one_line(_loom("bench", "latency", "--model", tiny_model_dir, "--device", "cuda"))
    assert "--device cuda" in line


def test_config_error_is_one_line(tiny_model_dir):
    line = _one_line(_loom("serve", tiny_model_dir, "--max-model-len", "100000"))
    assert "--max-model-len" in line


def test_serve_raises_the_open_file_limit():
    """`loom serve` lifts the soft descriptor limit (1,024 on many systems: about a thousand idle
    connections locked everyone out of an API server) up to 65,536 within the hard limit."""
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, soft), hard)); "
            "from frontend.entrypoints.launcher import raise_open_file_limit; raise_open_file_limit(); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    soft, hard = (int(x) for x in out.stdout.split())
    import resource
    assert soft == (65536 if hard == resource.RLIM_INFINITY else min(65536, hard)), out


def test_serve_flag_mistakes_are_config_errors(tiny_model_dir):
    """Each was a traceback (exit 1), or silently accepted: now a ConfigError, which `loom serve`
    prints as one line with exit 2 (shown end to end for the first)."""
    from frontend.entrypoints.args import engine_config_from_args
    from frontend.entrypoints.launcher import _check_args
    from ipc.config import ConfigError
    assert "--api-key must not be empty" in _one_line(_loom("serve", tiny_model_dir, "--api-key", ""))  # (auth off)
    for args, words in ((["--port", "70000"], "--port"), (["--engine-address", "garbage"], "tcp://HOST:PORT"),
                        (["--limit-mm-per-prompt", '{"image": "x"}'], "--limit-mm-per-prompt"),
                        (["--api-server-count", "0"], "--api-server-count")):
        parsed = _root_parser().parse_args(["serve", tiny_model_dir, *args])
        with pytest.raises(ConfigError, match=words):
            _check_args(parsed, engine_config_from_args(parsed).resolve())


def test_broken_model_files_and_offline_options_are_config_errors(tiny_model_dir, tmp_path):
    """A model's config.json or generation_config.json that is not a JSON object, and LLM(...)
    options of the wrong type or outside their choices (only the command line checked those):
    ConfigError naming what is wrong, before any process starts."""
    import shutil
    from ipc.config import ConfigError, EngineConfig
    for name, text in (("config.json", "{bad"), ("config.json", "[1, 2]"), ("generation_config.json", "{oops"),
                       ("config.json", '{"max_position_embeddings": "abc"}')):
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_model_dir, d)
        (d / name).write_text(text)
        with pytest.raises(ConfigError, match=name):
            EngineConfig(model=str(d)).resolve()
    bare = tmp_path / "no-tokenizer"   # (transformers made an empty tokenizer of it: every text encoded to [])
    bare.mkdir()
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), bare)
    from frontend import LLM
    with pytest.raises(ConfigError, match="has no tokenizer"):
        LLM(str(bare))
    for kw, words in ((dict(scheduling_policy="lifo"), "--scheduling-policy must be one of"),
                      (dict(reasoning_parser="bogus"), "--reasoning-parser"),
                      (dict(max_num_seqs="8"), "--max-num-seqs must be an int"),
                      (dict(seed=10 ** 30), "--seed"), (dict(max_logprobs=-2), "--max-logprobs"),
                      (dict(kv_cache_memory_bytes=0), "--kv-cache-memory-bytes")):
        with pytest.raises(ConfigError, match=words):
            EngineConfig(model=tiny_model_dir, **kw).resolve()
    # vLLM's -1: no limit on logprobs (the whole vocabulary); it made every logprobs request a 400
    assert EngineConfig(model=tiny_model_dir, max_logprobs=-1).resolve().max_logprobs > 0


def test_a_kv_cache_too_small_exits_2_without_a_traceback(tiny_model_dir):
    """Found by the engine core after start-up, it is still a configuration mistake: exit 2 (was 1),
    and the worker leaves quietly as the engine closes its ring (it printed a RingClosed traceback)."""
    r = _loom("serve", tiny_model_dir, "--num-gpu-blocks-override", "1", "--port", "0")
    assert r.returncode == 2 and "needs" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_bench_argument_mistakes_are_one_line(tiny_model_dir, tmp_path):
    """Each was a traceback, after a whole engine start for some (an empty median of --iters 0)."""
    assert "--iters: must be at least 1" in _one_line(_loom("bench", "latency", "--model", tiny_model_dir, "--iters", "0"))
    assert "has no config.json" in _one_line(_loom("bench", "throughput", "--model", str(tmp_path)))
    r = _loom("bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2")   # nothing there
    assert r.returncode == 1 and "cannot reach --base-url" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ctrl_c_while_loom_serve_loads_is_one_line(tiny_model_dir):
    """SIGINT at once, before `loom serve` installs its handler (it printed a KeyboardInterrupt
    traceback): 'interrupted' and 130; or, if it landed later, the clean stop (0)."""
    import signal
    import time
    proc = popen_serve(tiny_model_dir, "--port", "0", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.8)   # past the interpreter's start, inside the imports and the model's config
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (130, 0) and "Traceback" not in err, (proc.returncode, err[-2000:])
