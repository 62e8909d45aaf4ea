"""Shared memory: the one-writer/N-reader broadcast ring from the engine core
to its workers, and (later) the object store for multimodal tensors."""
