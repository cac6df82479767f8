"""The host backend: the pinned ggml (libggml-base + libggml-cpu) through ctypes.

``abi`` is generated from the pinned headers (``scripts/gen-ggml-abi``), ``lib`` loads and
checks the libraries. The server's host ops are ggml-cpu's own kernels, run by graph plans.
"""
