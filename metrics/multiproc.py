"""The private directory of prometheus_client's multiprocess mode, owned by `loom serve`.

The launcher creates it empty before any API server starts and exports it as
PROMETHEUS_MULTIPROC_DIR, which the spawned API servers inherit (prometheus_client
reads it when first imported there). Each process then keeps its values in
files in it, and /metrics in any process merges them. The launcher removes the
directory when it exits, whatever the reason; a directory left by a launcher
that was SIGKILLed is never reused (each start makes a new one).

This module must not import prometheus_client: the launcher only manages the
directory.
"""
from __future__ import annotations

import os
import shutil
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"


def make_multiproc_dir() -> str:
    """A new empty directory, exported in this process's environment for the children it starts."""
    path = tempfile.mkdtemp(prefix="loom-metrics-")
    os.environ[ENV] = path
    return path


def remove_multiproc_dir(path: str | None) -> None:
    if not path:
        return
    shutil.rmtree(path, ignore_errors=True)
    if os.environ.get(ENV) == path:
        del os.environ[ENV]
