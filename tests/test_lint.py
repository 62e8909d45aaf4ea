"""ruff over the whole tree, with the rules in pyproject.toml (pyflakes and pycodestyle's errors):
an unused import or an undefined name fails `make test`, as a wrong-way import does
(tests/test_import_contract.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import ROOT


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency (pyproject.toml [test]); `make install` puts it in the venv"
    r = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
