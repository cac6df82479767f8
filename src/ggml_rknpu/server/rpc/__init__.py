"""ggml RPC protocols 7.0.0 and 8.0.0: wire layouts (``wire``), the accept loop (``listener``),
one connection (``server.Session``) and its command handlers (``buffer_commands``,
``tensor_commands``, ``proto8``), the settings (``config``), shared state (``state``) and its
report (``report``)."""
