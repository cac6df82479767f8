"""Shared fixtures. ``reference_dir`` is the oracle data the golden, capture and decoded
tests compare against (``tests/data/oracle``, see its README)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
    """No test reads or writes the user's own ladder record (~/.config/ggml-rknpu), nor
    another test's: each starts from the proven envelope."""
    monkeypatch.setenv("RKNPU_ENVELOPE_FILE", str(tmp_path / "envelope.json"))
    monkeypatch.delenv("RKNPU_ENVELOPE", raising=False)


@pytest.fixture(scope="session")
def host_ggml():
    """The pinned ggml loaded through ctypes (libggml.lib); skips where it is not built yet."""
    from ggml_rknpu.libggml import lib
    try:
        return lib.load()
    except lib.GgmlLibraryMissing as exc:
        pytest.skip(str(exc))
