"""``Connection``: what a session's command handlers (``buffer_commands``, ``tensor_commands``,
``proto8``) use of their ``server.Session``: its socket and reader, the shared state, its
buffers, and the checks, the invalidation and the reply every handler shares."""

from __future__ import annotations

import socket
from typing import Protocol

from ggml_rknpu.server.buffers import BufferTable, RpcBuffer
from ggml_rknpu.server.rpc.deadlines import Deadlines, Reader
from ggml_rknpu.server.rpc.state import ServerState
from ggml_rknpu.server.tensor import CheckedTensor


class Connection(Protocol):
    reader: Reader
    deadlines: Deadlines
    sock: socket.socket
    state: ServerState
    peer: str
    buffers: BufferTable

    def device(self, dev: int, what: str) -> int:
        """``dev``, or ProtocolError: no such device."""
        ...

    def target(self, payload: bytes, offset: int, what: str) -> tuple[CheckedTensor, RpcBuffer]:
        """The checked tensor at ``offset`` of ``payload`` and the buffer it lies in."""
        ...

    def written(self, buf: RpcBuffer, start: int, end: int) -> None:
        """Bytes [start, end) of ``buf`` changed: drop what was derived from them."""
        ...

    def send(self, payload: bytes) -> None:
        """One reply (size header, then ``payload``), counted."""
        ...

    def count_out(self, n: int) -> None:
        """``n`` bytes were sent outside ``send``."""
        ...

    def compute_graph(self, dev: int, payload: bytes, digest: bytes, replay: bool = False) -> None: ...
