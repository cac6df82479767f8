"""Weight pages: the GGUF bytes of a weight no host kernel reads, moved from anonymous memory
into a file the kernel can write back, drop and read again, at the same addresses.

A weight with a repacked host copy or a staged NPU copy needs its uploaded bytes only for
GET_TENSOR, re-staging after a fault or an eviction, and readers such as GET_ROWS: the
kernel may page them out like llama.cpp's own mmap of the GGUF. The page-aligned interior of
the weight's range is written to an unlinked file on disk (one per buffer, sparse, at the
buffer's offsets) and mapped shared over the same virtual range (``MAP_FIXED``), so every
view of the buffer reads and writes the same bytes as before. Invariants: only page-aligned
ranges of buffers the table mapped itself move; a range moves once; a directory on tmpfs is
refused at start-up (its pages are shared memory, not droppable). Why: docs/memory.md
"One host copy per weight"."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from ggml_rknpu.hw.alignment import align_up

log = logging.getLogger("ggml_rknpu.rpc")

PAGE = mmap.PAGESIZE
_FIXED = 0x10                 # MAP_FIXED (Linux mman-common.h)
_MAP_FAILED = ctypes.c_void_p(-1).value
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})   # their pages are memory, never written out


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mmap.restype = ctypes.c_void_p
    return libc


def filesystem_type(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The type of the filesystem holding ``path`` (the longest mount point above it), or None."""
    best, kind = "", None
    target = str(path.resolve())
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        point, fstype = fields[4], fields[fields.index("-") + 1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def default_directory() -> Path:
    """Where ``rknpu serve`` keeps weight pages: the user's cache directory (on disk on a board,
    where /tmp is often tmpfs)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ggml-rknpu" / "weight-pages"


@dataclass
class WeightPages:
    """The store's directory and what it holds now (``bytes``: weight bytes file-backed)."""

    directory: Path
    bytes: int = 0

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        kind = filesystem_type(self.directory)
        if kind in RAM_FILESYSTEMS:
            raise ValueError(f"{self.directory} is on {kind}: its pages are memory the kernel cannot drop; "
                             "give a directory on disk")

    def describe(self) -> str:
        return f"weights with a repacked or NPU copy paged to {self.directory} (file-backed, droppable)"


@dataclass(eq=False)
class BufferPages:
    """One buffer's file of weight pages; ``address`` is the buffer's first byte in memory."""

    store: WeightPages
    address: int
    size: int
    _file: int = -1
    _moved: list[tuple[int, int]] = field(default_factory=list)   # page-aligned [start, end) now file-backed
    moved_bytes: int = 0
    failed: bool = False           # the store failed once: nothing more moves

    def keep(self, start: int, end: int) -> int:
        """Move the whole pages inside bytes [start, end) of the buffer to the file; the bytes
        moved (0: none whole, moved already, or the store failed: then the buffer's bytes stay
        anonymous from here on, said once, e.g. on a full disk)."""
        lo = align_up(self.address + start, PAGE) - self.address
        hi = (self.address + end) // PAGE * PAGE - self.address
        if self.failed or hi <= lo or any(s < hi and lo < e for s, e in self._moved):
            return 0
        try:
            self._move(lo, hi)
        except OSError as exc:
            self.failed = True
            log.warning("weight pages: the buffer's weights stay in anonymous memory: %s", exc)
            return 0
        self._moved.append((lo, hi))
        self.moved_bytes += hi - lo
        self.store.bytes += hi - lo
        return hi - lo

    def _move(self, lo: int, hi: int) -> None:
        """Write the buffer's bytes [lo, hi) to the file and map the file over them."""
        if self._file < 0:
            self._file = os.open(self.store.directory, os.O_TMPFILE | os.O_RDWR, 0o600)
            os.ftruncate(self._file, self.size)
        view = (ctypes.c_char * (hi - lo)).from_address(self.address + lo)
        if os.pwrite(self._file, memoryview(view).cast("B"), lo) != hi - lo:
            raise OSError(f"short write of {hi - lo} weight bytes to {self.store.directory}")
        got = _libc().mmap(self.address + lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE,
                           mmap.MAP_SHARED | _FIXED, self._file, lo)
        if got == _MAP_FAILED or got != self.address + lo:
            raise OSError(ctypes.get_errno(), f"cannot map weight pages over the buffer: {os.strerror(ctypes.get_errno())}")

    def close(self) -> None:
        """The buffer was freed: its file goes when its mapping does (the file is unlinked)."""
        self.store.bytes -= self.moved_bytes
        self.moved_bytes = 0
        if self._file >= 0:
            os.close(self._file)
            self._file = -1


def anonymous_buffer(size: int) -> mmap.mmap:
    """``size`` zero bytes in a private anonymous mapping of their own (committed on first touch),
    so that ranges of it can be remapped to a file; unmapped when the last view goes."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
