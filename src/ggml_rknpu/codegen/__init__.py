"""Code generators: ggml's enums and ABI from the pinned llama.cpp headers and library.

Not imported at run time by the server; `scripts/gen-ggml-enums`, `scripts/gen-ggml-abi` and
`scripts/build-llama-cpp` (its client check) run them.
"""
