"""The import contract: imports point down the process chain, never up.

    the `loom` CLI  ->  bench  ->  entry points (LLM, launcher, DP coordinator, demo-model tools)
      ->  API server (frontend/openai)  ->  the frontend's engine side (engine client, detokenizer)
      ->  engine core  ->  workers  ->  kernels  ->  multimodal, metrics  ->  shm  ->  ipc

A module may import its own layer and any layer below it. Imports inside functions count too:
a lazy import still ties the lower process to the higher one's code. ipc/ is the ground that
every process stands on (wire messages, config, auth, shared helpers); nothing in it imports
anything above it. The check reads the source with `ast`, so it needs no import of the tree."""
from __future__ import annotations

import ast
import os

import pytest

from tests.conftest import ROOT

PACKAGES = ("frontend", "engine_core", "workers", "kernels", "multimodal", "metrics", "shm", "ipc", "bench")

# (module prefix, rank): lower ranks stand higher in the chain. The longest matching prefix wins;
# "frontend" alone is the package's __init__ (the public `from frontend import LLM`).
LAYERS: dict[str, int] = {
    "frontend.entrypoints.cli": 0,   # `loom bench` runs the bench package
    "bench": 1,
    "frontend.entrypoints": 2, "frontend.tools": 2,
    "frontend.openai": 3,
    "frontend.": 4,                  # the engine client, detokenizer, output processing, AsyncLLM
    "engine_core": 5,
    "workers": 6,
    "kernels": 7,
    "multimodal": 8, "metrics": 8,
    "shm": 9,
    "ipc": 10,
}
EXACT: dict[str, int] = {"frontend": 2}
# Imports that still point up, each with the work that removes it. Keep this empty.
KNOWN: set[tuple[str, str]] = set()


def rank_of(module: str) -> int:
    if module in EXACT:
        return EXACT[module]
    best = max((p for p in LAYERS if module == p.rstrip(".") or module.startswith(p if p.endswith(".") else p + ".")),
               key=len, default=None)
    if best is None:
        raise KeyError(f"{module} belongs to no layer of the contract")
    return LAYERS[best]


def module_name(path: str) -> str:
    mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return mod[:-len(".__init__")] if mod.endswith(".__init__") else mod


def imports_of(source: str, module: str) -> list[tuple[str, int]]:
    """(imported project module, line) for every import in the source, at any depth."""
    found = []
    package = module if module in PACKAGES else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against the package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            elif node.module:
                names = [node.module]
        found += [(n, node.lineno) for n in names if n.split(".")[0] in PACKAGES]
    return found


def violations(source: str, module: str) -> list[str]:
    mine = rank_of(module)
    return [f"{module}:{line} imports {target} (up the chain)"
            for target, line in imports_of(source, module)
            if rank_of(target) < mine and (module, target) not in KNOWN]


def project_modules():
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    yield module_name(path), path


def test_no_import_points_up_the_process_chain():
    bad = []
    for module, path in project_modules():
        with open(path) as f:
            bad += violations(f.read(), module)
    assert not bad, "imports against the contract:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("module, source", [
    ("ipc.config", "from multimodal.media import fetch_image\n"),
    ("engine_core.core", "def f():\n    from frontend.engine_client import EngineCoreClient\n"),
    ("workers.worker", "import engine_core.scheduler\n"),
    ("kernels.gemv", "from workers import distributed\n"),
    ("frontend.async_llm", "from frontend.openai.protocol import APIError\n"),
    ("frontend.openai.serving", "from frontend.entrypoints.llm import LLM\n"),
    ("bench.common", "from frontend.entrypoints.cli import main\n"),
])
def test_the_contract_catches_a_wrong_way_import(module, source):
    assert violations(source, module), f"{module} importing up the chain went unnoticed"


def test_every_module_has_a_layer():
    for module, _ in project_modules():
        rank_of(module)
