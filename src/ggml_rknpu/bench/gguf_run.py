"""What every benchmark that drives real llama.cpp against a GGUF starts with: the pinned
tools built, the model (``--model`` or the demo's gemma3-270m from PyPI) present, and the
report directory made. One place, so the benches fail the same way on a missing model."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ggml_rknpu.toolchain import launch, models


def prepare(args, console: Console, bench: str) -> tuple[Path, Path] | None:
    """(model, out directory), or None after saying why ``bench`` cannot run."""
    launch.ensure_built(quiet=True)
    model = Path(args.model or models.gemma3_270m(install=True))
    if not model.is_file():
        console.print(f"[red]bench {bench}: GGUF not found: {model}[/]")
        return None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return model, out
