"""One way to round a size up: ``hw.alignment.ceil_div`` and ``align_up``. An AST scan of
src/, tests/ and tools/ finds the hand-rolled forms (``-(-a // b)``, ``(a + b - 1) // b``,
``(a + (b - 1)) // b``, ``(a + 7) // 8``) anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "src" / "ggml_rknpu" / "hw" / "alignment.py"

def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


def _leftmost(node: ast.AST) -> ast.AST:
    """The first operand of a product: ``-a * b // c`` parses as ``((-a) * b) // c``."""
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        node = node.left
    return node


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 1


def hand_rolled(source: str) -> list[int]:
    """Line numbers of hand-rolled ceil-divides in ``source``."""
    lines: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)):
            continue
        num, den = node.left, node.right
        first = _leftmost(num)
        if isinstance(first, ast.UnaryOp) and isinstance(first.op, ast.USub):
            lines.append(node.lineno)                                   # -(-a // b)
        elif isinstance(num, ast.BinOp) and isinstance(num.op, ast.Sub) and _is_one(num.right) \
                and isinstance(num.left, ast.BinOp) and isinstance(num.left.op, ast.Add) \
                and _same(num.left.right, den):
            lines.append(node.lineno)                                   # (a + b - 1) // b
        elif isinstance(num, ast.BinOp) and isinstance(num.op, ast.Add):
            r = num.right
            if isinstance(r, ast.BinOp) and isinstance(r.op, ast.Sub) and _same(r.left, den) and _is_one(r.right):
                lines.append(node.lineno)                               # (a + (b - 1)) // b
            elif (isinstance(r, ast.Constant) and isinstance(den, ast.Constant) and type(r.value) is int
                  and type(den.value) is int and den.value > 1 and r.value == den.value - 1):
                lines.append(node.lineno)                               # (a + 7) // 8
    return sorted(lines)


def test_no_hand_rolled_ceil_divide_is_left():
    found = {}
    for top in ("src", "tests", "tools"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path != HOME and (lines := hand_rolled(path.read_text())):
                found[str(path.relative_to(ROOT))] = len(lines)
    assert found == {}


def test_the_scan_sees_each_form():
    probe = ("a = -(-n // 64) * 64\n"
             "b = -(-w * k // 32)\n"
             "c = (n + PAGE - 1) // PAGE\n"
             "d = (n + (PAGE - 1)) // PAGE\n"
             "e = (n + 7) // 8 * 8\n"
             "f = n // 8 + 1\n"
             "g = (n + 1) // 4\n"
             "h = -(n // 2)\n")
    assert hand_rolled(probe) == [1, 2, 3, 4, 5]
