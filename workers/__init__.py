"""Worker processes, one per device: model runner, KV cache, sampler."""
