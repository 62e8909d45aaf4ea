"""Multimodal input (images first, audio later): processing with the HF image
processors in the frontend, content hashes for prefix caching, and the encoder
inputs that workers read from the shared-memory object store. Empty for now."""
