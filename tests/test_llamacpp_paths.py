"""Locating the pinned llama.cpp: clear errors that say what to run when the cache is empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_rknpu.toolchain import llamacpp


def test_empty_cache_says_to_run_the_build_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path))
    assert llamacpp.cache_dir() == tmp_path
    for locate in (llamacpp.tools_dir, llamacpp.source_dir, llamacpp.plugin_path, llamacpp.base_library):
        with pytest.raises(llamacpp.LlamaCppNotBuilt, match="scripts/build-llama-cpp"):
            locate()


def test_partial_build_names_the_missing_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path))
    bin_dir = tmp_path / "llama.cpp-build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in llamacpp.TOOLS[:-1]:
        (bin_dir / name).touch()
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match=llamacpp.TOOLS[-1]):
        llamacpp.tools_dir()
    (bin_dir / llamacpp.TOOLS[-1]).touch()
    assert llamacpp.tools_dir() == bin_dir
    assert llamacpp.tool("llama-completion") == bin_dir / "llama-completion"
