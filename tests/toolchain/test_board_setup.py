"""The README's packages for a board are the arm64 root's: the set both commands ran from nothing
with (scripts/arm64-env makes the root with exactly these; docs/arm64.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_installs_what_the_arm64_root_has() -> None:
    root = re.search(r"^packages=(\S+)$", (ROOT / "scripts" / "arm64-env").read_text(), re.M)
    readme = re.search(r"^sudo apt install (.+)$", (ROOT / "README.md").read_text(), re.M)
    assert root and readme
    assert readme.group(1).split() == root.group(1).split(",")
