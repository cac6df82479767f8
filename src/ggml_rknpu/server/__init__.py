"""The ggml RPC server (protocol 7.0.0) that unmodified llama.cpp uses as a device."""
