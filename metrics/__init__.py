"""Prometheus metrics with vLLM-compatible names, collected in the API-server
processes from the per-step stats the engine core sends."""
