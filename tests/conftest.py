"""Shared fixtures. Tests that read the reference data in ``../shared`` use
``reference_dir`` and are skipped (not failed) where it is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """``../shared/reference`` (or ``$RKNPU_REFERENCE_DIR``); skips the test when absent."""
    path = Path(os.environ.get("RKNPU_REFERENCE_DIR", REPO_ROOT.parent / "shared" / "reference"))
    if not path.is_dir():
        pytest.skip(f"reference data not found at {path}")
    return path


@pytest.fixture(scope="session")
def host_ggml():
    """The pinned ggml loaded through ctypes (hostggml.lib); skips where it is not built yet."""
    from ggml_rknpu.hostggml import lib
    try:
        return lib.load()
    except lib.GgmlLibraryMissing as exc:
        pytest.skip(str(exc))
