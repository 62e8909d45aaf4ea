"""Benchmarks: `loom bench throughput|latency|serve`."""
