"""Tests skip only on a named missing precondition of the environment (a library, a client
build, a compiler), never because project code failed to import or open: no
``pytest.importorskip`` of a ``ggml_rknpu`` module, and no ``pytest.skip`` inside an
``except`` that catches everything (bare, ``Exception``, ``BaseException``). Such a skip
turns a broken module into a green run."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
BROAD = {"Exception", "BaseException"}


def _is_pytest_call(node: ast.AST, name: str) -> bool:
    """``pytest.<name>(...)`` or a bare ``<name>(...)`` (``from pytest import <name>``)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return ((isinstance(f, ast.Attribute) and f.attr == name and isinstance(f.value, ast.Name)
             and f.value.id == "pytest") or (isinstance(f, ast.Name) and f.id == name))


def _catches_everything(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    if caught is None:
        return True
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def forbidden_skips(source: str, filename: str = "<test>") -> list[str]:
    """Each forbidden skip in ``source`` as ``line: what``."""
    found: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if _is_pytest_call(node, "importorskip"):
            assert isinstance(node, ast.Call)
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] == "ggml_rknpu":
                found.append(f"{node.lineno}: importorskip({arg.value!r})")
        elif isinstance(node, ast.ExceptHandler) and _catches_everything(node):
            found.extend(f"{inner.lineno}: pytest.skip under a broad except (line {node.lineno})"
                         for stmt in node.body for inner in ast.walk(stmt)
                         if isinstance(inner, ast.Call) and _is_pytest_call(inner, "skip"))
    return sorted(found)


def test_no_test_skips_on_project_code():
    offenders = {str(path.relative_to(TESTS)): forbidden_skips(path.read_text(), str(path))
                 for path in sorted(TESTS.rglob("*.py"))}
    assert {p: f for p, f in offenders.items() if f} == {}


def test_the_check_sees_each_forbidden_kind():
    probe = '''
import pytest
mod = pytest.importorskip("ggml_rknpu.sim.npu", reason="not landed")
ok = pytest.importorskip("matplotlib")
def f():
    try:
        open_engine()
    except Exception as exc:
        pytest.skip(str(exc))
    try:
        open_engine()
    except (OSError, BaseException):
        if True:
            pytest.skip("x")
    try:
        open_engine()
    except:
        pytest.skip("x")
    try:
        build()
    except NotBuilt as exc:
        pytest.skip(str(exc))
'''
    assert forbidden_skips(probe) == [
        "14: pytest.skip under a broad except (line 12)",
        "18: pytest.skip under a broad except (line 17)",
        "3: importorskip('ggml_rknpu.sim.npu')",
        "9: pytest.skip under a broad except (line 8)",
    ]
