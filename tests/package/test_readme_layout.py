"""README's "Where things live" block names exactly the packages under src/ggml_rknpu, and every
top-level module it names exists: a newcomer's map of the tree cannot drift from the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "ggml_rknpu"


def layout_entries(readme: str) -> list[str]:
    """The names the layout block lists under ``src/ggml_rknpu/`` (``x/`` a package, ``x.py`` a module)."""
    section = readme.split("## Where things live", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block is not None, "README's layout block is missing"
    lines = block.group(1).splitlines()
    start = lines.index("src/ggml_rknpu/") + 1
    entries = []
    for line in lines[start:]:
        if not line.startswith("  "):          # the next top-level folder (scripts/, docs/, ...)
            break
        entries.append(line.split()[0])
    return entries


def test_the_layout_names_every_package_and_only_packages():
    entries = layout_entries((ROOT / "README.md").read_text())
    listed = {e.removesuffix("/") for e in entries if e.endswith("/")}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert listed == packages


def test_the_top_level_modules_it_names_exist():
    entries = layout_entries((ROOT / "README.md").read_text())
    modules = [e for e in entries if not e.endswith("/")]
    assert modules and all(e.endswith(".py") and (PACKAGE / e).is_file() for e in modules), modules


def test_the_parser_reads_a_block():
    readme = ("## Where things live\n\n```\nsrc/ggml_rknpu/\n  a.py  x\n  ggml/   y\n  b/  z\n"
              "scripts/  s\n  c/ not ours\n```\n")
    assert layout_entries(readme) == ["a.py", "ggml/", "b/"]
