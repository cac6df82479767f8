"""Every module under src/ stays small enough to read whole: at most ``MAX_LINES`` lines. A
module that grows past it is split by concern (as server/rpc/ and sim/kernel/ are), not
trimmed of its docstrings. The generated register table is data, not a module to read."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ggml_rknpu"
MAX_LINES = 500


def line_counts(root: Path) -> dict[str, int]:
    return {path.relative_to(root).as_posix(): len(path.read_text().splitlines())
            for path in sorted(root.rglob("*.py"))}


def test_no_module_is_over_the_limit():
    long = {rel: n for rel, n in line_counts(SRC).items() if n > MAX_LINES}
    assert long == {}, f"split these by concern: at most {MAX_LINES} lines a module"


def test_the_count_sees_a_long_module(tmp_path: Path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n")
    assert line_counts(tmp_path) == {"long.py": MAX_LINES + 1, "short.py": 1}
