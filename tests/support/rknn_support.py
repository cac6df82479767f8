"""The librknnrt stand-in (tests/rknn_standin/rknn_standin.c) built with gcc, shared by the
binding/engine tests and the ``serve --engine rknn`` / ``bench --engines rknn`` tests.

Import the fixture into a test module with ``from rknn_support import standin_path``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

STANDIN = Path(__file__).parents[1] / "rknn_standin" / "rknn_standin.c"


def build_so(tmp: Path, source: Path, name: str) -> Path:
    """``source`` compiled into the shared library ``tmp/name``; skips when gcc is missing."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed: cannot build the librknnrt stand-in")
    out = tmp / name
    subprocess.run([gcc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(source)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def standin_path(tmp_path_factory) -> Path:
    return build_so(tmp_path_factory.mktemp("rknn"), STANDIN, "librknnrt.so")
