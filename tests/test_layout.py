"""The project's shape: top-level packages, the `loom` command, and no confusion
between our package names and the libraries we use."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

from tests.conftest import ROOT

PACKAGES = ["frontend", "engine_core", "workers", "ipc", "kernels", "multimodal", "shm", "metrics"]


def test_top_level_packages_have_docstrings():
    for name in PACKAGES:
        mod = importlib.import_module(name)
        assert os.path.dirname(mod.__file__) == os.path.join(ROOT, name)
        assert (mod.__doc__ or "").strip(), f"{name}/__init__.py needs a docstring saying what lives there"


def test_transformers_is_not_confused_by_our_kernels_package():
    """transformers probes for the HF hub `kernels` package; ours must not look like it."""
    code = ("import kernels, transformers\n"
            "from transformers.utils import import_utils as iu\n"
            "assert kernels.__file__.startswith(%r), kernels.__file__\n"
            "assert not iu.is_kernels_available(), 'transformers thinks hub kernels are installed'\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "m = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,\n"
            "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
            "import torch; m(torch.tensor([[1, 2, 3]]))\n"
            "print('ok')\n") % os.path.join(ROOT, "kernels")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_loom_command_exists():
    r = subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout and "demo-model" in r.stdout and "bench" in r.stdout


def test_served_demo_model_continues_the_zen(demo_model_dir, start_server):
    import openai
    server = start_server(demo_model_dir, "--max-model-len", "512")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="Beautiful is better than", max_tokens=8, temperature=0)
    assert r.choices[0].text.startswith(" ugly.")
    chat = client.chat.completions.create(model=model, max_tokens=20, temperature=0,
                                          messages=[{"role": "user", "content": "Recite the Zen of Python."}])
    assert chat.choices[0].message.content.startswith("Beautiful is better than ugly.")


def test_engine_core_starts_without_torch():
    """The engine core starts its workers first thing: importing torch (~2 s) would delay every start."""
    code = "import sys, engine_core.core, engine_core.executor; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr[-2000:]
