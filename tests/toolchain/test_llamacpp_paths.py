"""Locating the pinned llama.cpp: clear errors that say what to run when the cache is empty."""

from __future__ import annotations

import subprocess
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


def test_vulkan_build_matches_the_build_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned tree built with ggml-vulkan: its own build dir and tools, as scripts/build-llama-cpp
    --vulkan makes them; missing, it says to run that; the script builds it only for the pinned client."""
    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path))
    script = Path(__file__).resolve().parents[2] / "scripts" / "build-llama-cpp"
    tools = llamacpp.BUILD_TOOLS[llamacpp.VULKAN]
    text = script.read_text()
    assert "build_name=llama.cpp-build-vulkan\n" in text and f"targets=({' '.join(tools)})\n" in text
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="scripts/build-llama-cpp --vulkan"):
        llamacpp.tool("llama-bench", llamacpp.VULKAN)
    bin_dir = tmp_path / "llama.cpp-build-vulkan" / "bin"
    bin_dir.mkdir(parents=True)
    for name in tools:
        (bin_dir / name).touch()
    assert llamacpp.tools_dir(llamacpp.VULKAN) == bin_dir
    assert llamacpp.tool("llama-completion", llamacpp.VULKAN) == bin_dir / "llama-completion"
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="logger drain.*--vulkan"):
        llamacpp.tool_preload("llama-bench", llamacpp.VULKAN)
    refused = subprocess.run([str(script), "--vulkan", "b11434"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--vulkan builds only the pinned client" in refused.stderr


def test_logger_drain_is_preloaded_only_into_tools_that_log_through_common(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="logger drain"):
        llamacpp.tool_preload("llama-completion")
    drain = tmp_path / "llama.cpp-build" / "bin" / llamacpp.LOG_DRAIN_NAME
    drain.parent.mkdir(parents=True)
    drain.touch()
    assert llamacpp.tool_preload("llama-completion") == {"LD_PRELOAD": f"/opt/other.so {drain}"}
    assert llamacpp.tool_preload("test-backend-ops") == {}
    assert llamacpp.tool_preload("ggml-rpc-server") == {}


@pytest.mark.llama
def test_completion_output_is_complete_under_cpu_load(tmp_path: Path) -> None:
    """With the drain preloaded, a ~20 ms tiny-model run keeps its whole output while both cores
    are busy (without it, 16 of 20 such runs lost their text and timings on this machine)."""
    import subprocess

    from support.e2e_support import completion, tool_or_skip
    from support.gguf_models import write_tiny_gguf

    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    spinners = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(3)]
    try:
        for _ in range(5):
            text, proc = completion(model, "The capital of France is", n_predict=8)
            assert proc.returncode == 0 and text and " eval time =" in proc.stderr, proc.stderr[-2000:]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _fake_ggml(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True)
    for name in llamacpp.GGML_LIBS:
        (bin_dir / name).touch()
    return bin_dir


def test_ggml_libraries_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$RKNPU_GGML_LIB_DIR (alone), then the full pinned build, then the ggml-only build; missing
    everywhere names scripts/build-ggml."""
    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path))
    monkeypatch.delenv(llamacpp.GGML_LIB_DIR_ENV, raising=False)
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="run scripts/build-ggml"):
        llamacpp.ggml_library_dir()
    only_ggml = _fake_ggml(tmp_path / "ggml-build" / "bin")
    assert llamacpp.ggml_library_dir() == only_ggml == llamacpp.ggml_build_dir()
    full = _fake_ggml(tmp_path / "llama.cpp-build" / "bin")
    assert llamacpp.ggml_library_dir() == full
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    monkeypatch.setenv(llamacpp.GGML_LIB_DIR_ENV, str(chosen))
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="RKNPU_GGML_LIB_DIR"):
        llamacpp.ggml_library_dir()                          # never silently another build
    _fake_ggml(chosen / "bin")
    monkeypatch.setenv(llamacpp.GGML_LIB_DIR_ENV, str(chosen / "bin"))
    assert llamacpp.ggml_library_dir() == chosen / "bin"


def test_ggml_build_variants_match_the_build_script() -> None:
    script = (Path(__file__).resolve().parents[2] / "scripts" / "build-ggml").read_text()
    for variant, build_dir in llamacpp.GGML_BUILDS.items():
        assert f"build_name={build_dir}\n" in script, variant
    bad = subprocess.run([str(Path(__file__).resolve().parents[2] / "scripts" / "build-ggml"), "--nosuch"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: scripts/build-ggml [--asan]" in bad.stderr


def test_first_run_builds_only_the_ggml_libraries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rknpu serve` on a machine with no build runs scripts/build-ggml once (here a stand-in that
    makes the two files), and never when $RKNPU_GGML_LIB_DIR names the build to use."""
    from ggml_rknpu.toolchain import launch

    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(llamacpp.GGML_LIB_DIR_ENV, raising=False)
    script = tmp_path / "repo" / "scripts" / "build-ggml"
    script.parent.mkdir(parents=True)
    script.write_text('#!/bin/sh\nd="$RKNPU_CACHE/ggml-build/bin"; mkdir -p "$d"\n'
                      'touch "$d/libggml-base.so" "$d/libggml-cpu.so"; echo ran >> "$RKNPU_CACHE/runs"\n')
    script.chmod(0o755)
    monkeypatch.setattr(launch, "REPO_ROOT", tmp_path / "repo")
    assert launch.ensure_ggml_built() == tmp_path / "cache" / "ggml-build" / "bin"
    assert launch.ensure_ggml_built() == tmp_path / "cache" / "ggml-build" / "bin"
    assert (tmp_path / "cache" / "runs").read_text() == "ran\n"              # built once
    monkeypatch.setenv(llamacpp.GGML_LIB_DIR_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="RKNPU_GGML_LIB_DIR"):
        launch.ensure_ggml_built()
    assert (tmp_path / "cache" / "runs").read_text() == "ran\n"
