"""Shared fixtures. ``reference_dir`` is the oracle data the golden, capture and decoded
tests compare against (``tests/data/oracle``, see its README)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest



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
