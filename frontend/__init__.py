"""The frontend: API servers (OpenAI-compatible HTTP), the offline LLM class,
tokenization, chat templates and incremental detokenization."""
from ipc.lora import LoRARequest
from ipc.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams"]


def __getattr__(name):
    # Imported lazily so that `import frontend` stays light (the CLI, spawned children).
    if name == "LLM":
        from frontend.entrypoints.llm import LLM
        return LLM
    if name == "PoolingParams":   # vLLM's, for LLM.embed / classify / score (frontend/pooling.py)
        from frontend.pooling import PoolingParams
        return PoolingParams
    raise AttributeError(name)
