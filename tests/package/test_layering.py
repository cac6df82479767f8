"""The package's layering, read from the source (AST of every module under src/, imports
inside functions included): lower layers never import higher ones, and no module takes
part in an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "ggml_rknpu"

# layer -> the layers it may import (itself included). sim/ is never below kernel/:
# the opener (ggml_rknpu.devices) chooses between them from above.
ALLOWED = {
    "hw": {"hw"},
    "kernel": {"kernel", "hw"},
    "compiler": {"compiler", "hw", "cost"},
}
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


def test_lower_layers_import_nothing_above_them():
    wrong = sorted(f"{m} imports {i}" for m in GRAPH if _layer(m) in ALLOWED
                   for i in GRAPH[m] if _layer(i) not in ALLOWED[_layer(m)])
    assert wrong == []


def test_no_import_cycles():
    cycles = _cycles()
    assert [sorted(c) for c in cycles if c not in KNOWN_CYCLES] == []
    assert [sorted(c) for c in KNOWN_CYCLES if c not in cycles] == [], "a known cycle is gone: drop it from the list"


def test_the_checks_catch_a_violation(monkeypatch):
    monkeypatch.setitem(GRAPH, "ggml_rknpu.kernel.device", GRAPH["ggml_rknpu.kernel.device"] | {"ggml_rknpu.sim.kernel"})
    monkeypatch.setitem(GRAPH, "ggml_rknpu.hw.limits", GRAPH["ggml_rknpu.hw.limits"] | {"ggml_rknpu.kernel.job"})
    assert frozenset({"hw.limits", "kernel.job"}) in _cycles()
    wrong = [i for i in GRAPH["ggml_rknpu.kernel.device"] if _layer(i) not in ALLOWED["kernel"]]
    assert wrong == ["ggml_rknpu.sim.kernel"]
