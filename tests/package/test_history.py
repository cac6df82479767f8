"""Code, tests and docs say what a thing is; what was measured when is in docs/history.md and
who did what in the commit log. A scan of src/, tests/, docs/, scripts/ and README.md for the
forms history takes in a tree: milestones of the prototype named instead of cited, lettered
interface contracts, issue and stop numbers, branch talk, engineers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = ROOT / "docs" / "history.md"
THIS = Path(__file__).resolve()
# (pattern, what it is); case-insensitive. Upstream trackers are cited as "<project> issue #N"
# (or "llama.cpp issue N").
FORBIDDEN: tuple[tuple[str, str], ...] = (
    (r"\bseed(?: log)?,? milestones?\b|\bmilestones? \d", "a prototype milestone (cite docs/history.md §N)"),
    (r"\bcontracts? [A-G](?:\b|[-–])", "a lettered contract (name the interface)"),
    (r"(?<!llama\.cpp )\bissues? \d+", "an issue number"),
    (r"\bstop \d+\b", "a stop number"),
    (r"\bthis branch\b|\bbranch h\d+|\bon main at\b|\bre-run on main\b", "branch talk"),
    (r"\bengineers?\b", "an engineer"),
    (r"\b(?:before|after) this change\b", "a change narrative"),
)
SKIP_DIRS = {"data", "fixtures", "__pycache__"}


def _files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in ("src", "tests", "docs", "scripts"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in ("", ".py", ".md", ".sh", ".toml") \
                    and not SKIP_DIRS & set(path.relative_to(ROOT).parts) and path not in (HISTORY, THIS):
                files.append(path)
    return files


def history_in(text: str) -> list[str]:
    return [f"{n}: {what}: {m.group(0)!r}" for n, line in enumerate(text.splitlines(), 1)
            for pattern, what in FORBIDDEN for m in [re.search(pattern, line, re.IGNORECASE)] if m]


def test_no_history_in_the_tree():
    found = {str(p.relative_to(ROOT)): f for p in _files() if (f := history_in(p.read_text(errors="replace")))}
    assert found == {}


def test_the_scan_sees_each_form_and_lets_citations_through():
    assert len(history_in("as seed Milestone 7 measured\ncontract D [docs/decisions.md]\n"
                          "(issue 16)\nsince this branch\nengineer K\nstop 3 of the plan\n")) == 6
    assert history_in("[docs/history.md §7]\nollama issue #5001\nllama.cpp issue 22142\n"
                      "reverse engineering\nthe seed's figures\n") == []
