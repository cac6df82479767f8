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


def test_clients_match_the_build_script_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python side mirrors scripts/build-llama-cpp's client names, build dirs and tools."""
    import subprocess

    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path))
    script = Path(__file__).resolve().parents[2] / "scripts" / "build-llama-cpp"
    listing = subprocess.run([str(script), "--list"], capture_output=True, text=True, check=True).stdout
    rows = {line.split()[0]: line for line in listing.splitlines()}
    assert tuple(rows) == llamacpp.CLIENTS
    for client, tools in llamacpp.CLIENT_TOOLS.items():
        build_dir, listed_tools = rows[client].split()[4], rows[client].split("(")[1].rstrip(")").split()
        bin_dir = Path(build_dir) / "bin"
        assert bin_dir.parent.parent == tmp_path and set(listed_tools) == set(tools)
        hint = "scripts/build-llama-cpp" + ("" if client == llamacpp.PINNED else f" {client}")
        with pytest.raises(llamacpp.LlamaCppNotBuilt, match=hint):
            llamacpp.tools_dir(client)
        bin_dir.mkdir(parents=True)
        for name in tools:
            (bin_dir / name).touch()
        assert llamacpp.tools_dir(client) == bin_dir
    unknown = subprocess.run([str(script), "nosuch"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown client 'nosuch'" in unknown.stderr
    with pytest.raises(ValueError, match="unknown llama.cpp client"):
        llamacpp.tools_dir("nosuch")
