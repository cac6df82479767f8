"""No module reaches into another object's private members: every ``<expr>._name`` under src/
(and every ``getattr``/``setattr``/``hasattr`` of a literal ``"_name"``) has ``self``, ``cls`` or
``super()`` as its object, and no module imports another's ``_name`` from the package. What
another module needs is a public member, method or function (a seam)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ggml_rknpu"
OWN = frozenset({"self", "cls"})
# The standard library's own underscore API, which has no public spelling: ctypes' structure
# layout (``_fields_``) and the classes its type stubs name (``_Pointer``, ``_CData``, ...).
PYTHON_API = frozenset({"_fields_", "_Pointer", "_CData", "_CArgObject", "_CFunctionType"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in PYTHON_API


def _own(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in OWN
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def reach_ins(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every use of another object's private member in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and not _own(node.args[0])):
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ggml_rknpu")
              and any(_private(alias.name) for alias in node.names)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _all() -> dict[tuple[str, str], list[int]]:
    uses: dict[tuple[str, str], list[int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for line, expr in reach_ins(path.read_text()):
            uses.setdefault((path.relative_to(SRC).as_posix(), expr), []).append(line)
    return uses


def test_no_module_uses_another_objects_private_members():
    uses = _all()
    found = sorted(f"{module}:{lines} {expr}" for (module, expr), lines in uses.items())
    assert found == [], "make it a public member or method of its class"


def test_the_scan_sees_a_reach_in():
    source = ("from ggml_rknpu.bench.decode import _models, model_weights\n"
              "class A:\n"
              "    def f(self, other):\n"
              "        self._x = super()._y + other._z + getattr(other, '_w') + self.dev._q\n"
              "        return hasattr(self, '_v'), s._fields_, __name__.__class__\n")
    assert sorted(reach_ins(source)) == [(1, "from ggml_rknpu.bench.decode import _models, model_weights"),
                                         (4, "getattr(other, '_w')"), (4, "other._z"), (4, "self.dev._q")]
