"""The llama.cpp b11739 client (protocol 8.0.0): the ``llama-cpp-py-sync==0.11739`` wheel, made
loadable on this machine, driven in a subprocess.

The wheel's prebuilt libraries (llama.cpp tag b11739) import four C23 functions from glibc 2.38
(``__isoc23_strtol``, ``__isoc23_strtoul``, ``__isoc23_strtoull``, ``__isoc23_sscanf``, version
GLIBC_2.38); on an older glibc (this machine has 2.36) they do not load. The fixture copies the
installed package into the project cache and, in each copied library, marks the GLIBC_2.38
version requirement weak (``VER_FLG_WEAK`` in its ``.gnu.version_r`` entry) and clears the four
symbols' versions (their ``.gnu.version`` entries become VER_NDX_GLOBAL, what ``patchelf
--clear-symbol-version`` does); ``c23_shim.c``, compiled with gcc and LD_PRELOADed, defines them
as the C99 functions. On glibc >= 2.38 the installed package is used as it is.

The client runs in a subprocess (``client_env`` gives its environment): a client that aborts,
as llama.cpp does on any RPC failure, must not take the test process with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ggml_rknpu.toolchain.launch import free_port
from ggml_rknpu.toolchain.llamacpp import cache_dir
from support.e2e_support import Server
from support.greedy import Step

WHEEL = "llama-cpp-py-sync==0.11739"
PACKAGE = "llama_cpp_py_sync"
C23_SYMBOLS = (b"__isoc23_strtol", b"__isoc23_strtoul", b"__isoc23_strtoull", b"__isoc23_sscanf")
GLIBC_C23 = b"GLIBC_2.38"
_SHIM_SOURCE = Path(__file__).with_name("c23_shim.c")

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
    """A named precondition of the fixture is missing (the reason is the skip message)."""


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
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(self.pythonpath), str(Path(__file__).parents[1])]),
                   OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        if self.preload is not None:
            env["LD_PRELOAD"] = str(self.preload)
        env.update(extra)
        return env


def client() -> Client:
    """The b11739 wheel, loadable here; WheelUnavailable names what is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise WheelUnavailable(f"{WHEEL} is not installed (scripts/bootstrap installs the project's "
                               "'client8' extra)")
    installed = Path(spec.origin).parent
    if _glibc_has_c23():
        return Client(installed.parent, None)
    if shutil.which("gcc") is None:
        raise WheelUnavailable(f"glibc {platform.libc_ver()[1]} lacks the C23 functions of {WHEEL} and there is "
                               "no gcc to build their stand-ins")
    stamp = f"{installed.stat().st_mtime_ns:x}-{_SHIM_SOURCE.stat().st_mtime_ns:x}"
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
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(tmp / shim.name), str(_SHIM_SOURCE)],
                       check=True)
        tmp.rename(root)
        ready.touch()
    return Client(root, shim)


# --- the driver that runs inside the subprocess ---------------------------------------------
_GREEDY = r"""
import json, sys
import numpy as np
from llama_cpp_py_sync import Llama
args = json.loads(sys.argv[1])
kw = dict(n_ctx=args["n_ctx"], n_batch=args["n_ctx"], n_threads=1, n_threads_batch=1, seed=1, verbose=False)
if args["rpc"]:
    kw.update(rpc_servers=args["rpc"], n_gpu_layers=99)
    if args.get("split_mode"):
        kw["split_mode"] = args["split_mode"]
if args.get("flash_attn") is not None:
    kw["flash_attn_type"] = args["flash_attn"]
llm = Llama(args["model"], **kw)
lib, ffi = llm._lib, llm._ffi
tokens = llm.tokenize(args["prompt"], add_special=True)
n_past = llm._eval_tokens(tokens, 0)
steps = []
for _ in range(args["n_predict"]):
    logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(llm._ctx, -1), 4 * llm.n_vocab), np.float32)
    logp = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
    first, second = (int(i) for i in np.argsort(-logp, kind="stable")[:2])
    steps.append([first, float(logp[first]), second, float(logp[second])])
    if llm.eos_token == first or lib.llama_vocab_is_eog(llm._vocab, first):
        break
    n_past = llm._eval_tokens([first], n_past)
text = llm.detokenize([s[0] for s in steps])
print("RESULT " + json.dumps({"steps": steps, "text": text}), flush=True)
llm.close()
"""


@dataclass(frozen=True)
class Greedy:
    steps: list[Step]
    text: str


def greedy(c: Client, model: Path, prompt: str, n_predict: int, *, rpc: list[str] | None = None,
           n_ctx: int = 256, timeout: float = 600, split_mode: str | None = None,
           flash_attn: int | None = None) -> Greedy:
    """Greedy tokens of the b11739 client (CPU-only, or every layer over ``rpc``), with each step's
    top-2 logprobs for the near-tie rule (support.greedy)."""
    args = {"model": str(model), "prompt": prompt, "n_predict": n_predict, "rpc": rpc or [], "n_ctx": n_ctx,
            "split_mode": split_mode, "flash_attn": flash_attn}
    proc = subprocess.run([sys.executable, "-c", _GREEDY, json.dumps(args)], env=c.env(), capture_output=True,
                          text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise AssertionError(f"b11739 client failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    out = json.loads(line[len("RESULT "):])
    return Greedy([Step(t, lp, r, rlp) for t, lp, r, rlp in out["steps"]], out["text"])


# The wheel's C++ RPC server (``ggml_backend_rpc_start_server``, what its rpc-server tool runs) on
# the CPU device with one thread: the protocol 8.0.0 reference.
_SERVER = r"""
import sys
from llama_cpp_py_sync._cffi_bindings import get_backend_base_lib, get_backend_lib, get_ffi, get_lib, get_rpc_lib
ffi = get_ffi()
get_lib().llama_backend_init()
backend, base = get_backend_lib(), get_backend_base_lib()
devices = [backend.ggml_backend_dev_get(i) for i in range(backend.ggml_backend_dev_count())]
cpu = [d for d in devices if base.ggml_backend_dev_type(d) == base.GGML_BACKEND_DEVICE_TYPE_CPU][:1]
get_rpc_lib().ggml_backend_rpc_start_server(sys.argv[1].encode(), ffi.NULL, 1, 1, ffi.new("ggml_backend_dev_t[]", cpu))
"""


class CppServer(Server):
    """The b11739 wheel's C++ 8.0.0 RPC server in a subprocess (prints ``Starting RPC server v8.0.0``)."""

    def __init__(self, c: Client, port: int, log_path: Path) -> None:
        super().__init__([sys.executable, "-c", _SERVER, f"127.0.0.1:{port}"], port, log_path, ready_timeout=60.0)
        self.client = c

    def env(self) -> dict[str, str]:
        return self.client.env()


def cpp_server(c: Client, tmp_path: Path) -> CppServer:
    port = free_port()
    return CppServer(c, port, tmp_path / f"b11739-rpc-server-{port}.log")
