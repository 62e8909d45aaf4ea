"""Entry points, in the `loom serve` parent or the caller's process: the `loom` CLI, the launcher
that starts engine cores and API servers, the offline `LLM`, and the data-parallel coordinator."""
