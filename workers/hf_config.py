"""The checkpoint's transformers config, read with transformers' config classes only.

    config = load_config(model_dir)      # AutoConfig's object, without transformers' model stack

Importing a config class's module imports more of transformers than the class needs, twice over:
- Every config class is decorated with `auto_docstring`, which looks the model class up in
  `transformers.models.auto.modeling_auto` to write the docstring. In transformers 5.17 (the H200
  image's) that table imports `auto_factory`, and with it `GenerationMixin`: scikit-learn (through
  generation/candidate_generator), DTensor and FSDP (transformers/distributed), torch._dynamo
  (masking_utils). Most of the worker's 8.9 s "config" phase on the device, for a docstring (later
  transformers import GenerationMixin lazily).
- Llama's config (and a dozen others') imports `transformers.utils.type_validators` for one range
  check; that module imports the activation table (`transformers.activations`) to check
  `hidden_act`, and the activations import the weight-loading code, DTensor and FSDP (5.17 and 5.24).
While the config loads, the table's import fails (`sys.modules[name] = None`, Python's way to
make an import fail), so the decorator takes its own `except ImportError` path, and the
validators find an empty activation table, as they do without torch, and leave `hidden_act`
unchecked (in configs made later in this process too: the validators keep that table). The class
and its fields are AutoConfig's; its docstring names no model class. Both stand-ins are gone
afterwards: the generic transformers path, which needs the real modules, imports them then.
Measured without bytecode (as the device image runs), after the worker's imports, on the CPU box:
Qwen3-0.6B's config 7.8 -> 1.7 s and Llama-3.1-8B's 8.1 -> 2.0 s with transformers 5.17 and
scikit-learn (3,600 -> 1,900 modules); Llama-3.1-8B's 4.2 -> 1.4 s with 5.24.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types

MODEL_TABLE = "transformers.models.auto.modeling_auto"
ACTIVATIONS = "transformers.activations"
VALIDATORS = "transformers.utils.type_validators"


@contextlib.contextmanager
def config_classes_only():
    """Inside, transformers' config classes import without its model stack: importing the model
    table fails, and the validators, imported here first, get an empty activation table. Modules
    already imported stand."""
    stand_ins: dict[str, types.ModuleType | None] = {}
    if MODEL_TABLE not in sys.modules:
        stand_ins[MODEL_TABLE] = None
    if VALIDATORS not in sys.modules and ACTIVATIONS not in sys.modules:
        stand_ins[ACTIVATIONS] = types.ModuleType(ACTIVATIONS)
        stand_ins[ACTIVATIONS].ACT2FN = {}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, module in stand_ins.items():
            if name in sys.modules and sys.modules[name] is module:
                del sys.modules[name]


def load_config(model_dir: str):
    """The checkpoint's transformers config (AutoConfig's), read with config classes only; read
    again plainly where some transformers' config path needs a module that was stood in for."""
    try:
        with config_classes_only():
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
