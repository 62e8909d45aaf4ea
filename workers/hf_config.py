"""The checkpoint's transformers config, read with transformers' config classes only.

    config = load_config(model_dir)      # AutoConfig's object, without transformers' model stack

Every transformers config class is decorated with `auto_docstring`, which, when the class's module
is imported, looks the model class up in `transformers.models.auto.modeling_auto` to write the
docstring. In transformers 5.17 (the H200 image's) importing that table imports `auto_factory`, and
with it `GenerationMixin`: scikit-learn (through generation/candidate_generator), the DTensor
package and FSDP (through transformers/distributed), torch._dynamo (masking_utils). That was most
of the worker's 8.9 s "config" phase on the device, for a docstring; later transformers import
GenerationMixin lazily. While the config loads, the table is hidden (`sys.modules[name] = None`,
Python's way to make an import fail), so the decorator takes its own `except ImportError` path:
the class is the same, its docstring names no model class. The worker never needs the table
unless it serves a model on the generic transformers path, which imports it afterwards.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

MODEL_TABLE = "transformers.models.auto.modeling_auto"


@contextlib.contextmanager
def without_model_table():
    """Imports of transformers' model-class table fail inside (those already made stand)."""
    if MODEL_TABLE in sys.modules:
        yield
        return
    sys.modules[MODEL_TABLE] = None
    try:
        yield
    finally:
        if sys.modules.get(MODEL_TABLE, 0) is None:
            del sys.modules[MODEL_TABLE]


def load_config(model_dir: str):
    """The checkpoint's transformers config (AutoConfig's), read with the model-class table hidden;
    again without hiding it where the config path of some transformers needs the table."""
    try:
        with without_model_table():
            return _read_config(model_dir)
    except ImportError:
        return _read_config(model_dir)


def _read_config(model_dir: str):
    """AutoConfig's object. A config that transformers reads only through remote code (InternLM2's)
    but whose architecture Loom implements is read as a plain PretrainedConfig of config.json's
    fields: no remote code runs (nor is asked for)."""
    from transformers import AutoConfig, PretrainedConfig

    from workers.models.registry import MODELS
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except ValueError:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        if (raw.get("architectures") or [None])[0] not in MODELS:
            raise
        return PretrainedConfig.from_dict(raw)
