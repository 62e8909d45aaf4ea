"""Where metrics live in one process, and how /metrics renders them.

Under `loom serve` every API server runs in prometheus_client's multiprocess
mode (PROMETHEUS_MULTIPROC_DIR, see metrics/multiproc.py): each process writes
its values to files in a shared directory, and /metrics on any of them merges
all the files (counters and histograms summed, gauges the most recent value).
Without that variable (an API server run in-process, tests) the process
registry is rendered directly.

Metric objects register in one per-process registry; registering a name again
(several apps or loggers built in one process) replaces the old collector.
"""
from __future__ import annotations

import glob
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from metrics.multiproc import ENV
_registry: CollectorRegistry | None = None


def multiproc_dir() -> str | None:
    return os.environ.get(ENV) or None


def process_registry() -> CollectorRegistry:
    global _registry
    if _registry is None:
        _registry = CollectorRegistry()
    return _registry


class Builder:
    """Creates metrics in a registry, replacing any earlier collector of the same name."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else process_registry()

    def _fresh(self, cls, name: str, doc: str, labelnames, **kw):
        names = self.registry._names_to_collectors  # no public lookup by name
        for key in (name, name + "_total", name + "_bucket"):
            old = names.get(key)
            if old is not None:
                self.registry.unregister(old)
        return cls(name, doc, labelnames=list(labelnames), registry=self.registry, **kw)

    def counter(self, name: str, doc: str, labelnames=()) -> Counter:
        return self._fresh(Counter, name, doc, labelnames)

    def gauge(self, name: str, doc: str, labelnames=(), mode: str = "mostrecent") -> Gauge:
        return self._fresh(Gauge, name, doc, labelnames, multiprocess_mode=mode)

    def histogram(self, name: str, doc: str, labelnames=(), buckets=Histogram.DEFAULT_BUCKETS) -> Histogram:
        return self._fresh(Histogram, name, doc, labelnames, buckets=buckets)


def collect_registry(kinds: tuple[str, ...] | None = None) -> CollectorRegistry:
    """What /metrics shows: every process's values in multiprocess mode, else this process's.
    kinds: only the files of these metric types ("counter", "gauge", "histogram"; None: all), in
    multiprocess mode: the stats log line reads counters and gauges, and parsing every histogram
    bucket of every process's file took ~3% of a busy API server's CPU."""
    path = multiproc_dir()
    if path is None:
        return process_registry()
    registry = CollectorRegistry()
    _ProcessFiles(registry, path, kinds)
    return registry


class _ProcessFiles(MultiProcessCollector):
    """prometheus_client's merge of every process's files, skipping a file that another
    process has only just created: it is empty until that process sizes it, and reading
    it raises (an API server starting beside another crashed on exactly that)."""

    def __init__(self, registry: CollectorRegistry, path: str, kinds: tuple[str, ...] | None = None):
        super().__init__(registry, path)
        self.dir = path
        self.patterns = [f"{kind}_*.db" for kind in kinds] if kinds else ["*.db"]   # (prometheus_client's names)

    def collect(self):
        files = [f for pattern in self.patterns for f in glob.glob(os.path.join(self.dir, pattern))]
        return self.merge([f for f in files if _nonempty(f)], accumulate=True)


def _nonempty(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:  # removed meanwhile
        return False


def render(accept_header: str | None = None) -> tuple[bytes, str]:
    """(body, content type) of a scrape, in the format the Accept header asks for."""
    encoder, content_type = choose_encoder(accept_header or "")
    return encoder(collect_registry()), content_type
