"""ggml RPC protocols 7.0.0 and 8.0.0: wire layouts (``wire``, ``proto8``) and the TCP server (``server``)."""
