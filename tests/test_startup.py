"""Start-up (issue 49): the decode graph sizes and --cuda-graph-sizes, the kept and keyed compile
cache, the start-up breakdown, and the targets table of bench/gpu_suite.sh."""
from __future__ import annotations

import json
import logging
import os

import pytest

from bench import targets
from frontend.entrypoints.args import LoomParser, add_engine_args
from ipc.compile_cache import compile_cache_dir, use_compile_cache
from ipc.config import ConfigError, EngineConfig
from ipc.startup import StartupTimes, process_age
from workers.decode_graphs import decode_batch_sizes


def test_decode_graph_sizes_and_the_flag(tiny_model_dir):
    assert decode_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_batch_sizes(256, [64]) == [1, 2, 4, 8, 16, 32, 64]      # one value: the pattern up to it
    assert decode_batch_sizes(256, [8, 1, 300]) == [1, 8, 256]           # several: those (capped)
    p = LoomParser()
    add_engine_args(p)
    assert p.parse_args(["--cuda-graph-sizes", "1", "4", "16"]).cuda_graph_sizes == [1, 4, 16]
    assert p.parse_args([]).cuda_graph_sizes is None
    assert EngineConfig(model=tiny_model_dir, cuda_graph_sizes=[1, 4]).resolve().cuda_graph_sizes == [1, 4]
    for bad in ([0], [], [2.5], 8):
        with pytest.raises(ConfigError, match="cuda-graph-sizes"):
            EngineConfig(model=tiny_model_dir, cuda_graph_sizes=bad).resolve()


def test_compile_cache_is_kept_under_loom_and_keyed(tmp_path, monkeypatch):
    from importlib import metadata
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("LOOM_CACHE_ROOT", str(tmp_path))
    path = compile_cache_dir()
    assert path.startswith(str(tmp_path / "triton")) and metadata.version("triton") in path
    assert metadata.version("torch").replace("+", "-") in path
    assert use_compile_cache() == path and os.path.isdir(path) and os.environ["TRITON_CACHE_DIR"] == path
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))   # the user's own wins
    assert compile_cache_dir() == str(tmp_path / "mine")


def test_startup_breakdown_logs_each_phase_at_debug(caplog):
    times = StartupTimes("worker 0")
    times.since_process_start("imports")
    with times.phase("weights"):
        pass
    assert 0 < times.phases[0][1] == pytest.approx(process_age(), abs=5) and times.phases[1][0] == "weights"
    with caplog.at_level(logging.DEBUG, logger="test.startup"):
        line = times.log(logging.getLogger("test.startup"))
    assert line.startswith("start-up of worker 0: imports ") and "weights 0.00 s" in line and " in all" in line
    assert caplog.records[0].levelno == logging.DEBUG


def test_targets_table_reads_the_suites_results(tmp_path, capsys):
    def write(name, obj):
        (tmp_path / name).write_text(json.dumps(obj))
    write("targets-qwen3.json", {"output_tok_per_s": 26000.0, "sampling": {
        "topp-only": {"ratio": 0.98}, "topp": {"ratio": 0.90}, "topp-penalties": {"ratio": 0.95}}})
    write("targets-serve-c256.json", {"output_throughput": 990.0})
    write("targets-offline-c256.json", {"output_tok_per_s": 1000.0})
    write("startup.json", {"qwen3-0.6b": {"fresh": 11.0, "second": None}})
    got = {t.name: v for t, v in targets.measure(str(tmp_path)) if t.name != "  second start"}
    assert got["offline workload, Qwen3-0.6B"] == 26000.0 and got["serving c256 vs offline, same shape"] == 0.99
    assert got["offline workload, Llama-3.1-8B"] is None
    targets.main([str(tmp_path)])
    out = {line[:40].strip(): line[40:].split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert out["top-p 0.95, no top-k vs plain"][-2:] == ["PASS", "(x)"]
    assert out["top-p 0.9 + top-k 50 vs plain"][-2:] == ["FAIL", "(x)"]
    assert out["loom serve to healthy, Qwen3-0.6B"][-2:] == ["PASS", "(s)"]
    assert out["JSON-schema constrained vs free"][-2:] == ["not", "run"]


def test_launcher_checks_import_neither_torch_nor_transformers(tiny_model_dir):
    """`loom serve` resolves and checks the config before it starts any child process: importing
    torch (1.5-3 s) or transformers there delays every child by as much. A quantized checkpoint
    may (its format is checked by workers/quantization)."""
    import subprocess
    import sys
    code = ("import sys; from ipc.config import EngineConfig; "
            "from workers.models.registry import check_architecture, multimodal_info; "
            f"EngineConfig(model={tiny_model_dir!r}, load_format='dummy').resolve(multimodal_info, check_architecture); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# What transformers' config classes pulled in (workers/hf_config.py): the model-class table,
# GenerationMixin and what 5.17's imports (scikit-learn where installed), and the DTensor and FSDP
# that Llama's config validators imported through the activations. None in a worker after its config.
MODEL_STACK = ("transformers.models.auto.modeling_auto", "transformers.generation.utils", "sklearn",
               "torch.distributed.tensor", "torch.distributed.fsdp")


def test_worker_reads_its_config_without_transformers_model_stack(tmp_path):
    """The worker's config path (after the worker's own imports) imports none of MODEL_STACK, and
    gives AutoConfig's object: the class and every field. The presets' config.json are 4.x style
    (rope_theta at the top, Llama 3's rope_scaling), which transformers 5 normalises. The stand-in
    activation table is gone afterwards."""
    import subprocess
    import sys

    from transformers import AutoConfig, GptOssConfig, Qwen2_5_VLConfig, Qwen3MoeConfig, WhisperConfig

    from bench.presets import PRESETS
    dirs = []
    for name in ("qwen3-0.6b", "llama-3.1-8b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(PRESETS[name]))
        dirs.append(str(tmp_path / name))
    for cls in (Qwen3MoeConfig, GptOssConfig, Qwen2_5_VLConfig, WhisperConfig):
        cls().save_pretrained(tmp_path / cls.__name__)
        dirs.append(str(tmp_path / cls.__name__))
    code = (
        "import json, sys\n"
        "import workers.worker, workers.model_runner, workers.model_loader  # the worker's imports\n"
        "from workers.hf_config import load_config\n"
        f"configs = [load_config(d) for d in {dirs!r}]\n"
        f"loaded = [m for m in {MODEL_STACK!r} if m in sys.modules]\n"
        "from transformers.activations import ACT2FN  # the real one, once the config is read\n"
        "print(json.dumps({'classes': [type(c).__name__ for c in configs], 'loaded': loaded, 'silu': 'silu' in ACT2FN,\n"
        "                  'configs': [json.loads(c.to_json_string(use_diff=False)) for c in configs]}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [] and got["silu"]
    for d, cls, cfg in zip(dirs, got["classes"], got["configs"], strict=True):
        want = AutoConfig.from_pretrained(d)
        assert cls == type(want).__name__ and cfg == json.loads(want.to_json_string(use_diff=False)), d


def test_launcher_check_still_refuses_an_unserved_quantization(tmp_path):
    from workers.models.registry import check_architecture
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                      "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ConfigError, match="unsupported quantization_config"):
        check_architecture(EngineConfig(model=str(tmp_path), load_format="dummy"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ConfigError, match="unsupported --quantization"):
        check_architecture(EngineConfig(model=str(tmp_path), load_format="dummy", quantization="nope"))


def test_load_model_times_config_build_and_fill_as_phases(tiny_model_dir):
    """The worker's weights phase is split (config: transformers' import; model built; weights
    filled), so that the start-up breakdown says which of them is slow; the model is the same."""
    import torch

    from workers import device_init
    from workers.model_loader import load_model
    device_init.start("cpu", 0)   # a CPU worker: no thread, and nothing to wait for
    assert device_init._thread is None
    device_init.wait()
    times = StartupTimes("worker 0")
    model = load_model(tiny_model_dir, torch.float32, "cpu", "dummy", startup=times)
    assert [name for name, _ in times.phases] == ["config", "model built", "weights filled"]
    plain = load_model(tiny_model_dir, torch.float32, "cpu", "dummy")
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), name


def test_startup_bench_reads_the_workers_phases_into_one_table(tmp_path):
    from bench.startup import breakdown, table, worker_phases
    log = tmp_path / "serve.log"
    log.write_text(
        "2026 loom DEBUG start-up of engine core 0: imports 0.90 s, workers started (imports, weights) 9.00 s; 20.00 s in all\n"
        "2026 worker0 DEBUG compiled the warm-up's kernels ahead: 900 launches dry in 0.80 s, compiles done after "
        "3.10 s (16 threads)\n"
        "2026 worker0 DEBUG start-up of worker 0: imports 4.30 s, CUDA init 0.20 s, config 0.50 s, model built 0.30 s, "
        "weights filled 0.40 s, runner state 0.30 s, profiling run 1.10 s, KV cache 0.05 s, warm-up (59 kernels "
        "compiled) 4.00 s, graph capture 2.50 s; 13.30 s in all\n")
    ph = worker_phases(str(log))
    assert ph == {"imports": 4.3, "cuda": 0.2, "config": 0.5, "built": 0.3, "filled": 0.4, "state": 0.3, "profile": 1.1, "kv": 0.05,
                  "warmup": 4.0, "compiled": 59.0, "capture": 2.5, "all": 13.3}
    assert breakdown(str(log)) == [
        "engine core 0: imports 0.90 s, workers started (imports, weights) 9.00 s; 20.00 s in all",
        "compiled the warm-up's kernels ahead: 900 launches dry in 0.80 s, compiles done after 3.10 s (16 threads)",
        "worker 0: imports 4.30 s, CUDA init 0.20 s, config 0.50 s, model built 0.30 s, weights filled 0.40 s, "
        "runner state 0.30 s, profiling run 1.10 s, KV cache 0.05 s, warm-up (59 kernels compiled) 4.00 s, graph capture 2.50 s; "
        "13.30 s in all"]
    lines = table([("qwen3-0.6b", "fresh", 15.0, 12.0, ph), ("qwen3-0.6b", "second", None, 6.0, {}),
                   ("qwen3-0.6b", "fresh, LOOM_COMPILE_THREADS=0", 40.0, None, {})])
    assert "FAIL" in lines[2] and lines[2].split()[2:5] == ["15.0", "12", "FAIL"] and lines[2].endswith("59    1.7")
    assert "never" in lines[3] and "FAIL" in lines[3] and "PASS" not in lines[4] and "FAIL" not in lines[4]


def test_early_cuda_init_without_a_gpu_fails_quietly(monkeypatch):
    """A worker told --device cuda on a machine without libcuda: the early thread gives up
    (the model runner's own CUDA init then reports why), and waiting for it returns."""
    from workers import device_init
    monkeypatch.setattr(device_init, "_thread", None)
    if device_init._driver_context(0):
        pytest.skip("this machine has a CUDA driver")
    device_init.start("cuda", 0)
    assert device_init._thread is not None
    device_init.wait()
    assert not device_init._thread.is_alive()


def test_startup_bench_keeps_to_its_budget(tmp_path, capsys):
    """A spent --budget skips every start (the targets' first, the A/B after), and the results
    file and the table are still written."""
    from bench.startup import main
    assert main(["--presets", "qwen3-0.6b", "--budget", "0", "--out", str(tmp_path)]) == {}
    out = capsys.readouterr().out
    assert out.count("skipped") == 3 and out.index("qwen3-0.6b fresh:") < out.index("qwen3-0.6b second:") \
        < out.index("LOOM_COMPILE_THREADS=0: skipped")
    assert json.loads((tmp_path / "startup.json").read_text()) == {}
    assert out.rstrip().splitlines()[-2].startswith("loom serve to healthy (dummy)")


def test_startup_bench_byte_compiles_the_import_path(tmp_path):
    """--compile-bytecode: every module under the given directories gets its .pyc, as a pip install
    writes them (the device image ships none and sets PYTHONDONTWRITEBYTECODE)."""
    import importlib.util

    from bench.startup import compile_bytecode
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("X = 1\n")
    compile_bytecode([str(tmp_path)])
    for name in ("pkg/__init__.py", "pkg/mod.py"):
        assert os.path.exists(importlib.util.cache_from_source(str(tmp_path / name))), name
