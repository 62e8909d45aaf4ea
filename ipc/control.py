"""The control operations' vocabulary, shared by every process that asks for them (the `LLM`,
the API servers, attached clients) and the engine core that owns the state."""
from __future__ import annotations

SLEEP_TAGS = ("weights", "kv_cache", "scheduling")
PAUSE_MODES = ("abort", "wait", "keep")
