"""The package's layering, read from the source (AST of every module under src/, imports
inside functions included): lower layers never import higher ones, and no module takes
part in an import cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "ggml_rknpu"

# layer -> the layers it may import (itself always allowed), lowest layer first. This is
# the table docs/architecture.md shows (test_the_documented_table_is_this_one); every
# package and top-level module of src/ggml_rknpu must have a row ("" is the package's own
# __init__, the public Python API). sim/ is never below kernel/: the opener
# (ggml_rknpu.devices) chooses between them from above.
ALLOWED: dict[str, set[str]] = {
    "hw": set(),
    "toolchain": set(),
    "kernel": {"hw"},
    "cost": {"hw"},
    "compiler": {"hw", "cost"},
    "sim": {"hw", "kernel", "cost"},
    "devices": {"kernel", "sim"},
    "engine": {"hw", "kernel", "cost", "compiler", "devices"},
    "rknn": {"hw", "kernel", "cost", "engine"},
    "libggml": {"toolchain"},
    "codegen": {"toolchain"},
    "server": {"hw", "kernel", "cost", "engine", "libggml", "toolchain"},
    "bench": {"hw", "toolchain", "kernel", "cost", "compiler", "sim", "devices", "engine", "rknn", "libggml",
              "server"},
    "cli": {"hw", "toolchain", "kernel", "cost", "compiler", "sim", "devices", "engine", "rknn", "libggml",
            "codegen", "server", "bench"},
    "": {"engine", "devices"},
}
ARCHITECTURE_MD = SRC.parent / "docs" / "architecture.md"
# Cycles that exist and have an owner; the test fails when one disappears too, so the
# list cannot outlive the cycle. None today.
KNOWN_CYCLES: list[frozenset[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}


def _imports(module: str) -> set[str]:
    """Package modules ``module`` imports anywhere in its body. ``from pkg import sub``
    counts as importing ``pkg.sub``; a module's own parent packages are not edges (Python
    runs them first whatever the module does)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
            found.update(subs or {base})
    parents = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
    return {m for m in found if m in MODULES and m != module and m not in parents}


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _cycles() -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(m.removeprefix(PACKAGE + ".") for m in component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_package():
    assert len(MODULES) > 50 and "ggml_rknpu.kernel.device" in GRAPH["ggml_rknpu.devices"]
    assert "ggml_rknpu.sim.kernel" in GRAPH["ggml_rknpu.devices"]  # a lazy import is still an edge


def test_every_layer_has_a_row():
    assert sorted({_layer(m) for m in GRAPH} - set(ALLOWED)) == []


def _violations() -> list[str]:
    return sorted(f"{m} imports {i}" for m in GRAPH for i in GRAPH[m]
                  if _layer(i) != _layer(m) and _layer(i) not in ALLOWED.get(_layer(m), set()))


def test_no_layer_imports_what_its_row_does_not_allow():
    assert _violations() == []


def _documented_table() -> dict[str, set[str]]:
    """The layer table of docs/architecture.md: first column the layer (`x/`, `x.py` or the
    package itself), last column the layers it may import (backticked names, or "nothing")."""
    rows: dict[str, set[str]] = {}
    for line in ARCHITECTURE_MD.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        layer = cells[0].strip("`").removesuffix("/").removesuffix(".py").removesuffix("__init__")
        layer = "" if layer in ("ggml_rknpu", "ggml_rknpu/") else layer
        rows[layer] = set(re.findall(r"`([a-z_]+)`", cells[-1]))
    return rows


def test_the_documented_table_is_this_one():
    assert _documented_table() == ALLOWED


def test_no_import_cycles():
    cycles = _cycles()
    assert [sorted(c) for c in cycles if c not in KNOWN_CYCLES] == []
    assert [sorted(c) for c in KNOWN_CYCLES if c not in cycles] == [], "a known cycle is gone: drop it from the list"


def test_the_checks_catch_a_violation(monkeypatch):
    monkeypatch.setitem(GRAPH, "ggml_rknpu.kernel.device", GRAPH["ggml_rknpu.kernel.device"] | {"ggml_rknpu.sim.kernel"})
    monkeypatch.setitem(GRAPH, "ggml_rknpu.hw.limits", GRAPH["ggml_rknpu.hw.limits"] | {"ggml_rknpu.kernel.job"})
    assert frozenset({"hw.limits", "kernel.job"}) in _cycles()
    assert _violations() == ["ggml_rknpu.hw.limits imports ggml_rknpu.kernel.job",
                             "ggml_rknpu.kernel.device imports ggml_rknpu.sim.kernel"]
    monkeypatch.setitem(GRAPH, "ggml_rknpu.newlayer", set())
    with pytest.raises(AssertionError):
        test_every_layer_has_a_row()
