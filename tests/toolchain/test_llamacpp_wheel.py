"""The b11739 wheel's libraries made loadable on glibc < 2.38 (docs/ggml-rpc.md P17): the ELF
edit leaves exactly the intended marks, checked with binutils' readelf, and the edited library
loads with the C23 stand-ins preloaded."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ggml_rknpu.toolchain import llamacpp_wheel


@pytest.fixture
def installed() -> Path:
    spec = importlib.util.find_spec(llamacpp_wheel.PACKAGE)
    if spec is None or spec.origin is None:
        pytest.skip(f"{llamacpp_wheel.WHEEL} is not installed (the 'client8' extra)")
    if shutil.which("readelf") is None:
        pytest.skip("binutils' readelf is not installed")
    return Path(spec.origin).parent


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", "--wide", *args], capture_output=True, text=True, check=True).stdout


def test_patch_weakens_glibc_2_38_and_unversions_the_four_symbols(installed: Path, tmp_path: Path) -> None:
    lib = tmp_path / "libllama.so"
    shutil.copy(installed / "libllama.so", lib)
    before = _readelf("--dyn-syms", str(lib))
    assert all(f"{s.decode()}@GLIBC_2.38" in before for s in llamacpp_wheel.C23_SYMBOLS)
    assert llamacpp_wheel.patch_c23(lib) == 4
    syms = _readelf("--dyn-syms", str(lib))
    for s in llamacpp_wheel.C23_SYMBOLS:
        assert re.search(rf" {s.decode()}$", syms, re.M), s          # no @version any more
    versions = _readelf("-V", str(lib))
    assert re.search(r"Name: GLIBC_2\.38\s+Flags: WEAK", versions), versions
    other = re.findall(r"Name: (GLIBC_2\.\d+)\s+Flags: none", versions)
    assert other and "GLIBC_2.38" not in other                      # the rest untouched
    assert llamacpp_wheel.patch_c23(lib) == 0                        # idempotent: nothing left to clear


def test_the_patched_package_loads(installed: Path) -> None:
    c = llamacpp_wheel.client()
    code = ("from llama_cpp_py_sync._cffi_bindings import get_lib, get_rpc_lib; "
            "assert get_lib().llama_supports_rpc(); print(get_rpc_lib().RPC_PROTO_MAJOR_VERSION)")
    proc = subprocess.run([sys.executable, "-c", code], env=c.env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "8"
