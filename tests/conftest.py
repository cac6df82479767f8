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


@pytest.fixture(autouse=True)
def _private_envelope_record(tmp_path, monkeypatch):
    """No test reads or writes the user's own ladder record (~/.config/ggml-rknpu), nor
    another test's: each starts from the proven envelope."""
    monkeypatch.setenv("RKNPU_ENVELOPE_FILE", str(tmp_path / "envelope.json"))
    monkeypatch.delenv("RKNPU_ENVELOPE", raising=False)
