"""ipc/envs.py: every LOOM_* variable the product code names is declared there, none is read
anywhere else, importing it reads nothing, and the flags that shadow four of them win."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from frontend.entrypoints.args import LoomParser
from frontend.entrypoints.cli import _serve_parser
from ipc import envs
from ipc.config import ConfigError, EngineConfig
from tests.conftest import ROOT

PRODUCT = ("frontend", "engine_core", "workers", "kernels", "multimodal", "metrics", "shm", "ipc", "bench")
NAME = re.compile(r"\bLOOM_[A-Z0-9_]*[A-Z0-9]\b")
# a read that bypasses ipc/envs.py: os.environ.get("LOOM_..."), os.getenv, os.environ["LOOM_..."]
# (not an assignment to it: variables our code sets for its children stay set that way), "in"
DIRECT_READ = re.compile(r"""(environ\.get|getenv)\(\s*["']LOOM_"""
                         r"""|environ\[\s*["']LOOM_\w+["']\s*\](?!\s*=[^=])"""
                         r"""|["']LOOM_\w+["']\s+(not\s+)?in\s+os\.environ""")


def product_sources() -> dict[str, str]:
    out = {}
    for pkg in PRODUCT:
        for path in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8") as f:
                out[os.path.relpath(path, ROOT)] = f.read()
    assert "ipc/envs.py" in out and len(out) > 50, "the product's sources were not found"
    return out


def test_every_loom_variable_in_the_product_is_declared():
    undeclared = {f"{path}: {name}" for path, src in product_sources().items() if path != "ipc/envs.py"
                  for name in NAME.findall(src) if name not in envs.ENVIRONMENT_VARIABLES}
    assert not undeclared, f"declare these in ipc/envs.py: {sorted(undeclared)}"


def test_no_loom_variable_is_read_outside_envs():
    direct = [f"{path}:{src[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
              for path, src in product_sources().items() if path != "ipc/envs.py"
              for m in DIRECT_READ.finditer(src)]
    assert not direct, f"read these through ipc/envs.py: {direct}"
    # the pattern finds what it is meant to find
    assert DIRECT_READ.search('x = os.environ.get("LOOM_GEMV", "1")')
    assert DIRECT_READ.search('x = int(os.environ["LOOM_STEPS_IN_FLIGHT"])')
    assert not DIRECT_READ.search('os.environ["LOOM_ENGINE_AUTH_KEY"] = key')


def test_importing_envs_reads_nothing():
    """A fresh interpreter whose os.environ records each key looked up: the import reads no
    LOOM_* variable, and an access reads exactly the one named."""
    code = """
import os
reads = []
class Spy(dict):
    def __getitem__(self, k): reads.append(k); return super().__getitem__(k)
    def get(self, k, d=None): reads.append(k); return super().get(k, d)
    def __contains__(self, k): reads.append(k); return super().__contains__(k)
os.environ = Spy(os.environ)
from ipc import envs
assert not [k for k in reads if str(k).startswith("LOOM_")], reads
os.environ["LOOM_GEMV"] = "0"
assert envs.LOOM_GEMV is False and [k for k in reads if str(k).startswith("LOOM_")] == ["LOOM_GEMV"], reads
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_values_are_read_at_each_access(monkeypatch):
    monkeypatch.delenv("LOOM_PDL", raising=False)
    assert envs.LOOM_PDL is True
    for text, want in [("0", False), ("false", False), ("OFF", False), ("1", True), ("true", True),
                       ("", True), ("junk", True)]:   # empty or unknown: the default, as before
        monkeypatch.setenv("LOOM_PDL", text)
        assert envs.LOOM_PDL is want, text
    for text, want in [("1", True), ("yes", True), ("0", False), ("", False), ("2", False)]:
        monkeypatch.setenv("LOOM_DEBUG_DISABLE_GC", text)
        assert envs.LOOM_DEBUG_DISABLE_GC is want, text
    monkeypatch.setenv("LOOM_STEPS_IN_FLIGHT", "")
    assert envs.LOOM_STEPS_IN_FLIGHT is None
    monkeypatch.setenv("LOOM_STEPS_IN_FLIGHT", "3")
    assert envs.LOOM_STEPS_IN_FLIGHT == 3
    monkeypatch.setenv("LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S", "2.5")
    assert envs.LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S == 2.5
    monkeypatch.setenv("LOOM_ATTACHED_OUTPUT_HWM", "many")
    with pytest.raises(ValueError, match="LOOM_ATTACHED_OUTPUT_HWM='many'"):
        envs.LOOM_ATTACHED_OUTPUT_HWM
    monkeypatch.setenv("LOOM_LOG_LEVEL", "debug")
    assert envs.LOOM_LOG_LEVEL == "DEBUG"
    with pytest.raises(AttributeError):
        envs.LOOM_NO_SUCH_VARIABLE


def test_flags_win_over_their_variables(monkeypatch, tiny_model_dir):
    for name in ("LOOM_STEPS_IN_FLIGHT", "LOOM_ATTACHED_OUTPUT_HWM", "LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    c = EngineConfig(model=tiny_model_dir).resolve()
    assert (c.steps_in_flight, c.attached_output_hwm, c.weight_update_join_timeout_s) == (None, 10_000, 120.0)
    monkeypatch.setenv("LOOM_STEPS_IN_FLIGHT", "3")
    monkeypatch.setenv("LOOM_ATTACHED_OUTPUT_HWM", "7")
    monkeypatch.setenv("LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S", "6")
    c = EngineConfig(model=tiny_model_dir).resolve()   # the variable is the default source
    assert (c.steps_in_flight, c.attached_output_hwm, c.weight_update_join_timeout_s) == (3, 7, 6.0)
    c = EngineConfig(model=tiny_model_dir, steps_in_flight=1, attached_output_hwm=50,
                     weight_update_join_timeout_s=30).resolve()
    assert (c.steps_in_flight, c.attached_output_hwm, c.weight_update_join_timeout_s) == (1, 50, 30)
    # ... and the resolved value travels with the config to the engine core and the workers
    assert EngineConfig.from_dict(c.to_dict()).weight_update_join_timeout_s == 30
    for bad in ({"steps_in_flight": 0}, {"attached_output_hwm": 0}, {"weight_update_join_timeout_s": 0}):
        with pytest.raises(ConfigError, match="--" + next(iter(bad)).replace("_", "-")):
            EngineConfig(model=tiny_model_dir, **bad).resolve()


def test_serve_flags():
    parser = LoomParser(prog="loom")
    _serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "M", "--log-level", "WARNING", "--steps-in-flight", "2",
                              "--attached-output-hwm", "9", "--weight-update-join-timeout-s", "1.5"])
    assert (args.log_level, args.steps_in_flight, args.attached_output_hwm,
            args.weight_update_join_timeout_s) == ("warning", 2, 9, 1.5)
    args = parser.parse_args(["serve", "M"])
    assert args.log_level is args.steps_in_flight is args.weight_update_join_timeout_s is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "M", "--log-level", "loud"])


def test_readme_lists_every_variable():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Environment variables"):]
    section = section[:section.index("\n## ")]
    missing = [name for name in envs.ENVIRONMENT_VARIABLES if f"`{name}`" not in section]
    assert not missing, f"README.md's 'Environment variables' section lacks {missing}"
    for flag in ("--log-level", "--steps-in-flight", "--attached-output-hwm", "--weight-update-join-timeout-s"):
        assert f"`{flag} " in readme, flag
