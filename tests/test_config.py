"""Start-up configuration read from config.json: limits that never start a process."""
from __future__ import annotations

import json

import pytest

from ipc.config import ConfigError, EngineConfig


def _model_dir(tmp_path, **cfg) -> str:
    base = {"architectures": ["MistralForCausalLM"], "max_position_embeddings": 4096, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(base | cfg))
    return str(tmp_path)


@pytest.mark.parametrize("cfg", [
    {"sliding_window": 1024},                                            # Mistral v0.1: every layer
    {"sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 20, "num_hidden_layers": 28},
    {"sliding_window": 1024, "layer_types": ["full_attention", "sliding_attention"]},
    {"sliding_window": None},
])
def test_max_model_len_is_the_models_context_whatever_the_window(tmp_path, cfg):
    # sliding-window attention runs in the kernels: the window no longer caps --max-model-len
    assert EngineConfig(model=_model_dir(tmp_path, **cfg)).resolve().max_model_len == 4096
    assert EngineConfig(model=_model_dir(tmp_path, **cfg), max_model_len=4096).resolve().max_model_len == 4096


def test_max_model_len_beyond_the_models_context_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_position_embeddings 4096"):
        EngineConfig(model=_model_dir(tmp_path, sliding_window=1024), max_model_len=8192).resolve()
