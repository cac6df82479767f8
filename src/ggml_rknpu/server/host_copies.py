"""Repacked host copies (``libggml.repack``) of the weights whose matmuls run in ggml-cpu,
one connection's, kept coherent with the GGUF bytes under them.

A host-placed MUL_MAT reads its weight from the copy, so ggml-cpu runs the kernel llama.cpp
alone would; types and shapes ggml does not repack keep the plain path. The GGUF bytes move
to the buffer's weight pages (file-backed, ``weight_pages``): the copy is the one anonymous copy.

Invariants: a copy is keyed like a staged weight (buffer, start, end, type, K, N); a command
writing its bytes marks it stale, repacked before the next segment reading it; bytes a graph
node writes make it volatile, repacked before every such segment (plans replay without
telling it); freeing the buffer frees its copies (FREE_BUFFER drops every stored plan).
Why: docs/placement.md "Repacked host copies"."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ggml_rknpu.libggml import repack
from ggml_rknpu.libggml.lib import Ggml
from ggml_rknpu.server.buffers import RpcBuffer
from ggml_rknpu.server.stats import ServerStats
from ggml_rknpu.server.tensor import CheckedTensor

log = logging.getLogger(__name__)


@dataclass(eq=False)
class HostCopy:
    """One weight's repacked copy; ``stale``: its GGUF bytes changed since it was repacked."""

    weight: repack.RepackedWeight
    start: int
    end: int
    name: str
    stats: ServerStats
    stale: bool = False
    volatile: bool = False

    def ensure(self) -> None:
        """Repack again if the bytes under it may have changed (a volatile copy: always)."""
        if self.stale or self.volatile:
            self.weight.refresh()
            self.stale = False
            self.stats.host_repack_refreshes += 1


@dataclass
class HostCopies:
    """The repacked copies of one connection (``enabled`` False: every host matmul runs plain)."""

    g: Ggml
    stats: ServerStats
    enabled: bool = True
    _copies: dict[tuple, HostCopy | None] = field(default_factory=dict)   # None: ggml does not repack it
    _by_buffer: dict[int, list[HostCopy]] = field(default_factory=dict)
    _made: list[int] = field(default_factory=lambda: [0, 0])    # copies, bytes made since the last log line

    def copy_for(self, t: CheckedTensor) -> HostCopy | None:
        """The repacked copy of the contiguous 2-D weight ``t`` (made on first use), or None."""
        r = t.rpc
        if not self.enabled or t.buffer is None:
            return None
        key = (t.buffer.handle, t.start, t.end, r.type, r.ne[0], r.ne[1])
        if key in self._copies:
            return self._copies[key]
        made = repack.repack(self.g, r.type, r.ne[0], r.ne[1], t.raw, r.name)
        if made is None:
            self._copies[key] = None
            return None
        copy = self._copies[key] = HostCopy(made, t.start, t.end, r.name, self.stats)
        t.buffer.keep_in_file(t.start, t.end)
        self._by_buffer.setdefault(t.buffer.handle, []).append(copy)
        self.stats.host_repacked += 1
        self.stats.host_repacked_bytes += made.nbytes
        self._made[0] += 1
        self._made[1] += made.nbytes
        return copy

    def log_made(self) -> None:
        """Say what the last plans repacked (host memory beside the GGUF bytes), once per batch."""
        n, nbytes = self._made
        if n:
            log.info("repacked host copies: %d weights, %.1f MiB in ggml-cpu's CPU_REPACK layout beside their "
                     "GGUF bytes", n, nbytes / 2**20)
            self._made[:] = [0, 0]

    def _overlapping(self, buffer: RpcBuffer, start: int, end: int) -> list[HostCopy]:
        return [c for c in self._by_buffer.get(buffer.handle, ()) if c.start < end and start < c.end]

    def invalidate(self, buffer: RpcBuffer, start: int, end: int) -> None:
        """Bytes [start, end) of ``buffer`` were written by a command: overlapping copies repack on next use."""
        for c in self._overlapping(buffer, start, end):
            c.stale = True

    def mark_graph_written(self, buffer: RpcBuffer, start: int, end: int) -> None:
        """A graph node writes [start, end): overlapping copies repack before every use from now on."""
        for c in self._overlapping(buffer, start, end):
            if not c.volatile:
                c.volatile = True
                log.info("repacked host copy of '%s': a graph writes its bytes, repacked before every use", c.name)

    def drop_buffer(self, buffer: RpcBuffer) -> None:
        """The buffer was freed: free its copies."""
        for c in self._by_buffer.pop(buffer.handle, ()):
            self.stats.host_repacked_bytes -= c.weight.nbytes
            c.weight.close()
        self._copies = {k: c for k, c in self._copies.items() if k[0] != buffer.handle}

    def close(self) -> None:
        for copies in self._by_buffer.values():
            for c in copies:
                self.stats.host_repacked_bytes -= c.weight.nbytes
                c.weight.close()
        self._by_buffer.clear()
        self._copies.clear()
