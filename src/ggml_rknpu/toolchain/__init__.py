"""Tooling around the server: locating and building llama.cpp, launching sessions, models.

Kept apart from the server (``ggml_rknpu.server``) it serves: nothing in the server imports it.
"""
