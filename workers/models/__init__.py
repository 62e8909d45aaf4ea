"""Our own torch implementations of the supported architectures."""
