"""Module docstrings stay short (what the module is, which invariants it keeps), and the
longer accounts they point at exist: the reasons and the history live in docs/
(docs/decisions.md "Why each module is as it is", docs/compiler.md, ...)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "ggml_rknpu"
MAX_LINES = 12
# Generated from Mesa's registers.xml: its docstring carries the MIT notice, which the
# licence requires every copy to keep.
EXEMPT = {"hw/_register_table.py"}
# docs/NAME.md "Heading" (the quoted words are part of a heading of that document)
SECTION = re.compile(r'docs/([\w-]+\.md)\s+"([^"\n]+)"')


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=True) or ""


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in EXEMPT:
            yield rel, path


def test_module_docstrings_are_a_few_lines():
    long = {rel: n for rel, path in _modules() if (n := len(_docstring(path).splitlines())) > MAX_LINES}
    assert long == {}, f"shorten to <= {MAX_LINES} lines; move the reasons to docs/decisions.md"


def _headings(doc: str) -> list[str]:
    return [line.lstrip("#").strip() for line in (ROOT / "docs" / doc).read_text().splitlines()
            if line.startswith("#")]


def test_sections_named_by_docstrings_exist():
    missing = []
    for rel, path in _modules():
        for doc, title in SECTION.findall(_docstring(path)):
            if not (ROOT / "docs" / doc).is_file() or not any(title in h for h in _headings(doc)):
                missing.append(f"{rel}: docs/{doc} \"{title}\"")
    assert missing == []


def test_the_section_check_reads_wrapped_references():
    text = 'Why: docs/decisions.md\n"bench/ladder.py"; figures: docs/decode.md "Server wiring".'
    assert SECTION.findall(text) == [("decisions.md", "bench/ladder.py"), ("decode.md", "Server wiring")]
