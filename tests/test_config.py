"""Start-up configuration read from config.json: limits that never start a process."""
from __future__ import annotations

import json

import pytest

from ipc.config import ConfigError, EngineConfig


def _model_dir(tmp_path, **cfg) -> str:
    base = {"architectures": ["MistralForCausalLM"], "max_position_embeddings": 4096, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(base | cfg))
    return str(tmp_path)


@pytest.mark.parametrize("cfg, limit", [
    ({"sliding_window": 1024}, 1024),                                    # Mistral v0.1: every layer
    ({"sliding_window": None}, 4096),                                    # Mistral v0.2+
    ({"sliding_window": 1024, "use_sliding_window": False}, 4096),       # Qwen2 default
    ({"sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 28,
      "num_hidden_layers": 28}, 4096),                                   # Qwen2: no layer past max_window_layers
    ({"sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 20,
      "num_hidden_layers": 28}, 1024),
    ({"sliding_window": 1024, "layer_types": ["full_attention"] * 4}, 4096),
    ({"sliding_window": 1024, "layer_types": ["full_attention", "sliding_attention"]}, 1024),
    ({"sliding_window": 8192}, 4096),                                    # wider than the model's context
])
def test_max_model_len_capped_at_the_sliding_window(tmp_path, cfg, limit):
    assert EngineConfig(model=_model_dir(tmp_path, **cfg)).resolve().max_model_len == limit


def test_max_model_len_beyond_the_window_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="sliding_window 1024"):
        EngineConfig(model=_model_dir(tmp_path, sliding_window=1024), max_model_len=2048).resolve()
    with pytest.raises(ConfigError, match="max_position_embeddings 4096"):
        EngineConfig(model=_model_dir(tmp_path), max_model_len=8192).resolve()
