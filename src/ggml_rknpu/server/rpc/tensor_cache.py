"""The ``ggml-rpc-server -c`` style tensor cache on disk: SET_TENSOR_HASH fills a tensor from a
file named by its FNV-1a-64, and a SET_TENSOR the client marks cacheable stores the bytes under
the hash it announced just before (one ``TensorCache`` per connection, files shared by all)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ggml_rknpu.server.buffers import RpcBuffer
from ggml_rknpu.server.rpc.wire import ProtocolError

log = logging.getLogger("ggml_rknpu.rpc")


class TensorCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pending: tuple[int, int, int] | None = None   # (buffer handle, address, announced hash)

    def load(self, buf: RpcBuffer, addr: int, digest: int, what: str) -> tuple[int, int] | None:
        """The buffer span now holding the bytes with this hash, or None: not in the cache (and
        the next cacheable SET_TENSOR at ``addr`` is stored under it)."""
        path = self.directory / f"{digest:016x}"
        if not path.is_file():
            self.pending = (buf.handle, addr, digest)
            return None
        self.pending = None
        n = path.stat().st_size
        start, end = buf.span(addr, n, what)
        with open(path, "rb") as f:
            if f.readinto(buf.array.data[start:end]) != n:
                raise ProtocolError(f"cache file {path} changed while reading")
        return start, end

    def store(self, buf: RpcBuffer, addr: int, start: int, end: int) -> None:
        """Store bytes the client marked cacheable under the hash it announced for them.

        Deviation from the C++ server (documented): the name is the FNV-1a-64 the client
        sent in the SET_TENSOR_HASH that immediately preceded this write, not a hash we
        recompute; a pure-Python FNV over a model's tensors would cost seconds per 10 MiB.
        """
        pending, self.pending = self.pending, None
        if pending is None or pending[:2] != (buf.handle, addr):
            return
        path = self.directory / f"{pending[2]:016x}"
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")   # sessions may store one hash at once
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(buf.array.data[start:end])
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write the tensor cache %s: %s", path, exc)
