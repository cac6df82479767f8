"""Where the pinned llama.cpp lives on this machine.

The ggml op/type enums and the RPC protocol are build-specific, so this project uses one
pinned llama.cpp: the tree vendored in the ``llama-cpp-python==0.3.36`` sdist (commit
0c1e570), built by ``scripts/build-llama-cpp`` into a cache outside the repository
(``$RKNPU_CACHE``, default ``~/.cache/ggml-rknpu``). This module only finds those files and
says clearly what to run when they are missing; it never builds anything itself.
"""

from __future__ import annotations

import os
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e570"
TOOLS = ("ggml-rpc-server", "test-backend-ops", "llama-completion", "llama-bench",
         "llama-perplexity", "llama-server")
PLUGIN_NAME = "librpc_env_plugin.so"
_HINT = "run scripts/build-llama-cpp (downloads the pinned sdist from PyPI and builds the tools)"


class LlamaCppNotBuilt(FileNotFoundError):
    """The pinned llama.cpp source or tools are not in the cache yet."""


def cache_dir() -> Path:
    """The project cache (``$RKNPU_CACHE`` or ``~/.cache/ggml-rknpu``); may not exist yet."""
    env = os.environ.get("RKNPU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ggml-rknpu"


def source_dir() -> Path:
    """The pinned llama.cpp source tree (real path, see ggml-rpc.md P4)."""
    path = cache_dir() / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if not (path / "ggml" / "include" / "ggml.h").is_file():
        raise LlamaCppNotBuilt(f"pinned llama.cpp source not found at {path}: {_HINT}")
    return path.resolve()


def tools_dir() -> Path:
    """Directory holding the built tools and shared libraries."""
    path = cache_dir() / "llama.cpp-build" / "bin"
    missing = [t for t in TOOLS if not (path / t).is_file()]
    if missing:
        raise LlamaCppNotBuilt(f"llama.cpp tools missing in {path} ({', '.join(missing)}): {_HINT}")
    return path


def tool(name: str) -> Path:
    """Path of one built tool, e.g. ``tool("llama-completion")``."""
    path = tools_dir() / name
    if not path.is_file():
        raise LlamaCppNotBuilt(f"llama.cpp tool {name!r} not found in {path.parent}: {_HINT}")
    return path


def plugin_path() -> Path:
    """The GGML_BACKEND_PATH plugin that exposes ``$GGML_RPC_ENDPOINT`` as device RPC0."""
    path = cache_dir() / "llama.cpp-build" / "bin" / PLUGIN_NAME
    if not path.is_file():
        raise LlamaCppNotBuilt(f"RPC plugin not found at {path}: {_HINT}")
    return path


def base_library() -> Path:
    """``libggml-base.so`` of the pinned build (type traits, op names for the enum generator)."""
    path = cache_dir() / "llama.cpp-build" / "bin" / "libggml-base.so"
    if not path.is_file():
        raise LlamaCppNotBuilt(f"libggml-base.so not found at {path}: {_HINT}")
    return path
