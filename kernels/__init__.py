"""Triton kernels, each with a pure-torch reference beside it.

Every public op has a `*_ref` implementation in plain torch (the CPU path and
the oracle for tests) and a Triton implementation that runs on the GPU, or on
the CPU under `TRITON_INTERPRET=1` in CI.

Note: transformers probes for an installed package called `kernels` (the HF
hub kernels library). Ours is found by `find_spec`, but its distribution
version (loom's) is outside transformers' accepted range, so transformers
treats hub kernels as unavailable; tests/test_layout.py checks this.
"""
