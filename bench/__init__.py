"""Benchmarks: `loom bench throughput|latency|serve|hf|preset` (bench/README.md)."""
