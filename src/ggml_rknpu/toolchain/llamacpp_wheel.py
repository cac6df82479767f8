"""The llama.cpp b11739 build of the ``llama-cpp-py-sync==0.11739`` wheel (RPC protocol 8.0.0),
made loadable on this machine: the client of the protocol-8 tests and benchmark, and its C++
8.0.0 RPC server as their reference.

Its prebuilt libraries import four C23 functions at version GLIBC_2.38 (docs/ggml-rpc.md P17).
On an older glibc, ``client()`` copies the installed package into the project cache, marks that
version requirement weak (``VER_FLG_WEAK`` in ``.gnu.version_r``), clears the four symbols'
versions (VER_NDX_GLOBAL in ``.gnu.version``, what ``patchelf --clear-symbol-version`` does) and
builds, with gcc, a library that defines them as the C99 functions, to be LD_PRELOADed. Programs
using the wheel run in a subprocess with ``Client.env()``: llama.cpp aborts on RPC failures.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ggml_rknpu.toolchain import launch, platform_wheels
from ggml_rknpu.toolchain.llamacpp import cache_dir

DISTRIBUTION = "llama-cpp-py-sync"
WHEEL = f"{DISTRIBUTION}==0.11739"
PACKAGE = "llama_cpp_py_sync"
C23_SYMBOLS = (b"__isoc23_strtol", b"__isoc23_strtoul", b"__isoc23_strtoull", b"__isoc23_sscanf")
GLIBC_C23 = b"GLIBC_2.38"
SHIM_SOURCE = r"""
/* The four C23 entry points the llama-cpp-py-sync 0.11739 wheel's libraries import from
 * glibc 2.38 (version GLIBC_2.38), defined as their C99 counterparts for an older glibc.
 * The C23 variants differ only in accepting "0b" binary prefixes and binary %i input,
 * which llama.cpp does not parse. Loaded with LD_PRELOAD (Client.env). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
unsigned long __isoc23_strtoul(const char *s, char **end, int base) { return strtoul(s, end, base); }
unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }

int __isoc23_sscanf(const char *s, const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    int n = vsscanf(s, format, ap);
    va_end(ap);
    return n;
}
"""

# ELF64 constants (System V gABI, GNU symbol versioning)
_SHT_DYNSYM = 11
_SHT_GNU_VERNEED = 0x6FFFFFFE
_SHT_GNU_VERSYM = 0x6FFFFFFF
_VER_FLG_WEAK = 0x2
_VER_NDX_GLOBAL = 1
_SHDR = struct.Struct("<IIQQQQIIQQ")
_VERNEED = struct.Struct("<HHIII")     # vn_version, vn_cnt, vn_file, vn_aux, vn_next
_VERNAUX = struct.Struct("<IHHII")     # vna_hash, vna_flags, vna_other, vna_name, vna_next
_SYM = struct.Struct("<IBBHQQ")


class WheelUnavailable(Exception):
    """A named precondition of loading the wheel is missing (the message says which)."""


def _cstr(data: bytes | bytearray, at: int) -> bytes:
    return bytes(data[at:data.index(b"\0", at)])


def patch_c23(path: Path) -> int:
    """Weaken the GLIBC_2.38 requirement and unversion the four C23 symbols in one ELF file;
    returns how many symbols were unversioned."""
    elf = bytearray(path.read_bytes())
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise WheelUnavailable(f"{path.name} is not a little-endian ELF64 library")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [_SHDR.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: s for s in sections}
    for needed in (_SHT_DYNSYM, _SHT_GNU_VERNEED, _SHT_GNU_VERSYM):
        if needed not in by_type:
            return 0
    dynsym, verneed, versym = by_type[_SHT_DYNSYM], by_type[_SHT_GNU_VERNEED], by_type[_SHT_GNU_VERSYM]
    strtab = sections[verneed[6]][4]                   # sh_link -> .dynstr offset
    c23_index = None
    at = verneed[4]
    for _ in range(verneed[7]):                        # sh_info: number of Verneed entries
        _, cnt, _, aux, nxt = _VERNEED.unpack_from(elf, at)
        a = at + aux
        for _ in range(cnt):
            vh, flags, other, name, anxt = _VERNAUX.unpack_from(elf, a)
            if _cstr(elf, strtab + name) == GLIBC_C23:
                _VERNAUX.pack_into(elf, a, vh, flags | _VER_FLG_WEAK, other, name, anxt)
                c23_index = other
            a += anxt
        if not nxt:
            break
        at += nxt
    cleared = 0
    dynstr = sections[dynsym[6]][4]
    for i in range(dynsym[5] // _SYM.size):
        name = _SYM.unpack_from(elf, dynsym[4] + i * _SYM.size)[0]
        if _cstr(elf, dynstr + name) in C23_SYMBOLS:
            slot = versym[4] + 2 * i
            if struct.unpack_from("<H", elf, slot)[0] & 0x7FFF == c23_index:
                struct.pack_into("<H", elf, slot, _VER_NDX_GLOBAL)
                cleared += 1
    path.write_bytes(elf)
    return cleared


def _glibc_has_c23() -> bool:
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(p) for p in version.split(".")[:2]) >= (2, 38)


@dataclass(frozen=True)
class Client:
    """Where the loadable package lives and what the subprocess needs to load it."""

    pythonpath: Path
    preload: Path | None

    def env(self, **extra: str) -> dict[str, str]:
        path = [str(self.pythonpath), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = launch.one_thread_env(PYTHONPATH=os.pathsep.join(path))
        if self.preload is not None:
            env["LD_PRELOAD"] = str(self.preload)
        env.update(extra)
        return env


def client() -> Client:
    """The b11739 wheel, loadable here; WheelUnavailable names what is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        for left_out in platform_wheels.left_out_here():
            if left_out.requirement.name == DISTRIBUTION:
                raise WheelUnavailable(f"{WHEEL} has no wheel for this machine ({platform.machine()}): "
                                       f"pyproject.toml installs it only where {left_out.requirement.marker}")
        raise WheelUnavailable(f"{WHEEL} is not installed: pip install -e '.[client8]' (scripts/bootstrap does)")
    installed = Path(spec.origin).parent
    if _glibc_has_c23():
        return Client(installed.parent, None)
    if shutil.which("gcc") is None:
        raise WheelUnavailable(f"glibc {platform.libc_ver()[1]} lacks the C23 functions of {WHEEL} and there is "
                               "no gcc to build their stand-ins")
    stamp = f"{installed.stat().st_mtime_ns:x}-{hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:12]}"
    root = cache_dir() / f"b11739-wheel-glibc{platform.libc_ver()[1]}"
    ready = root / f"ready-{stamp}"
    shim = root / "libc23shim.so"
    if not ready.is_file():
        if root.exists():
            shutil.rmtree(root)
        tmp = root.with_name(root.name + ".partial")
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(installed, tmp / PACKAGE)
        for lib in sorted((tmp / PACKAGE).glob("lib*.so*")):
            patch_c23(lib)
        (tmp / "c23_shim.c").write_text(SHIM_SOURCE)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(tmp / shim.name), str(tmp / "c23_shim.c")],
                       check=True)
        tmp.rename(root)
        ready.touch()
    return Client(root, shim)


# The wheel's C++ RPC server (``ggml_backend_rpc_start_server``, what its rpc-server tool runs) on
# the CPU device with one thread: the protocol 8.0.0 reference.
SERVER_SCRIPT = r"""
import sys
from llama_cpp_py_sync._cffi_bindings import get_backend_base_lib, get_backend_lib, get_ffi, get_lib, get_rpc_lib
ffi = get_ffi()
get_lib().llama_backend_init()
backend, base = get_backend_lib(), get_backend_base_lib()
devices = [backend.ggml_backend_dev_get(i) for i in range(backend.ggml_backend_dev_count())]
cpu = [d for d in devices if base.ggml_backend_dev_type(d) == base.GGML_BACKEND_DEVICE_TYPE_CPU][:1]
get_rpc_lib().ggml_backend_rpc_start_server(sys.argv[1].encode(), ffi.NULL, 1, 1, ffi.new("ggml_backend_dev_t[]", cpu))
"""




def start_cpp_server(c: Client, port: int, *, log: IO | None = None) -> subprocess.Popen:
    """The wheel's C++ 8.0.0 RPC server (CPU, one thread) on 127.0.0.1:port, ready for connections."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, f"127.0.0.1:{port}"], env=c.env(),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        launch.wait_for_port(proc, port, 60.0, "the b11739 RPC server")
    except BaseException:
        launch.stop(proc)
        raise
    return proc
