"""The ggml RPC server (protocols 7.0.0 and 8.0.0) that unmodified llama.cpp uses as a device."""
