"""ggml RPC protocol 7.0.0: wire layouts (``wire``) and the TCP server (``server``)."""
