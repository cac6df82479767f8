"""Shared fixtures. ``reference_dir`` is the oracle data the golden, capture and decoded
tests compare against (``tests/data/oracle``, see its README).

The session is hermetic: ``pytest_configure`` gives it (and every subprocess it starts) a
home and config of its own before anything is imported, so no test reads or writes the
user's ``~/.config`` or ``~/.cache``; only the client builds stay where the build scripts
put them (``$RKNPU_CACHE``, resolved against the real home first)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ggml_rknpu.engine.envelope_record import FILE_ENV, OVERRIDE_ENV
from ggml_rknpu.sim.kernel import misuse
from ggml_rknpu.toolchain import llamacpp
from support.misuse_check import assert_no_misuse

_SESSION_HOME: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Before collection (module- and session-scoped fixtures open engines, which read the
    envelope record): the client builds' cache pinned to its real place, then HOME and the
    XDG directories moved to a private directory, and the envelope record with them."""
    global _SESSION_HOME
    if _SESSION_HOME is not None:
        return
    os.environ["RKNPU_CACHE"] = str(llamacpp.cache_dir())
    _SESSION_HOME = Path(tempfile.mkdtemp(prefix="ggml-rknpu-test-home-"))
    os.environ["HOME"] = str(_SESSION_HOME)
    for var, sub in (("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache"), ("XDG_DATA_HOME", ".local/share")):
        os.environ[var] = str(_SESSION_HOME / sub)
    os.environ[FILE_ENV] = str(_SESSION_HOME / ".config" / "ggml-rknpu" / "envelope.json")
    os.environ.pop(OVERRIDE_ENV, None)
    # every subprocess (servers, tools) appends its simulated kernels' misuses here: _no_kernel_misuse
    os.environ[misuse.LOG_ENV] = str(_SESSION_HOME / "kernel-misuse.log")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_HOME is not None:
        shutil.rmtree(_SESSION_HOME, ignore_errors=True)


# The tests `-m arm64` selects besides tests/e2e/test_arm64.py (marked there): what the arm64
# root (scripts/arm64-env, docs/arm64.md) runs. Node-id prefixes, relative to the repository.
ARM64_SUBSET = (
    "tests/libggml/",                                      # the ctypes binding and its ABI check
    "tests/server/test_rpc_fuzz_asan.py::test_sanitizer_sees_an_out_of_bounds_read",
    "tests/server/test_rpc_fuzz_asan.py::test_every_mutation_of_every_case_is_refused_or_safe",  # the fuzz's CI part
    # f16 weights: llama and qwen2; qwen3's 12th token differs on arm64 because ggml-cpu's ARM f16
    # dot product, the CPU-only reference, accumulates in fp16 (docs/arm64.md)
    "tests/e2e/test_e2e_tiny_models.py::test_greedy_tokens_equal_cpu[pinned-llama-",
    "tests/e2e/test_e2e_tiny_models.py::test_greedy_tokens_equal_cpu[pinned-qwen2-",
    "tests/bench/test_bench_rig.py",                       # check-rig on the fake sysfs trees
    "tests/bench/test_bench_selftest.py",                  # selftest on the simulator
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(ARM64_SUBSET):
            item.add_marker(pytest.mark.arm64)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """``tests/data/oracle`` (or ``$RKNPU_REFERENCE_DIR``). Never skips: the data is in the repository."""
    path = Path(os.environ.get("RKNPU_REFERENCE_DIR", Path(__file__).resolve().parent / "data" / "oracle"))
    assert path.is_dir(), f"oracle data not found at {path}"
    return path


@pytest.fixture(autouse=True)
def _private_envelope_record(tmp_path, monkeypatch):
    """No test reads or writes another test's ladder record: each starts from the proven
    envelope (the session's record, see ``pytest_configure``, is for fixtures wider than a test)."""
    monkeypatch.setenv(FILE_ENV, str(tmp_path / "envelope.json"))
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)


@pytest.fixture(scope="session")
def host_ggml():
    """The pinned ggml loaded through ctypes (libggml.lib); skips where it is not built yet."""
    from ggml_rknpu.libggml import lib
    try:
        return lib.load()
    except lib.GgmlLibraryMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def _no_kernel_misuse():
    """A call the real kernel lets pass but a board pays for (sim.kernel.misuse) fails the test
    during which it was made, in this process or in any it started (a server, a tool); tests
    that make one on purpose take it with ``misuse.drain()`` (``assert_no_misuse`` for a
    subprocess's)."""
    misuse.drain()
    yield
    assert_no_misuse()
