"""Every citation in src/ resolves inside the repository (scripts/check-citations)."""

from __future__ import annotations

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check-citations"
check = runpy.run_path(str(SCRIPT))


def test_no_reference_in_src_points_outside_the_repository():
    report = [p for path in sorted(check["SRC"].rglob("*.py")) for p in check["problems"](path, path.read_text())]
    assert report == []


def test_the_check_catches_outside_references():
    bad = '"""Hardware facts [npu-programming.md §3; ../shared/reference/x]."""\nX = 1  # [§4]\n'
    path = check["ROOT"] / "src" / "example.py"
    assert len(check["problems"](path, bad)) == 3
    good = '"""Hardware facts [docs/npu-programming.md §3; docs/history.md §7]."""\nX = 1  # [§4]\n'
    assert check["problems"](path, good) == []
