"""The device and buffer commands of a connection: DEVICE_COUNT, GET_ALIGNMENT, GET_MAX_SIZE,
GET_DEVICE_MEMORY, GET_ALLOC_SIZE, ALLOC_BUFFER, BUFFER_GET_BASE, FREE_BUFFER, BUFFER_CLEAR; and
the connection's own buffer bytes (``--session-memory``), with the trim of the C heap after
frees (docs/memory.md "The C library's heap")."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ggml_rknpu.server.buffers import BUFFER_ALIGNMENT, RpcBuffer
from ggml_rknpu.server.host_budget import TRIM_AFTER_FREED_BYTES, return_free_heap
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.connection import Connection
from ggml_rknpu.server.rpc.wire import Cmd
from ggml_rknpu.server.tensor import RpcTensor, nbytes

log = logging.getLogger("ggml_rknpu.rpc")


class BufferCommands:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.allocated = 0                # bytes of this connection's buffers (--session-memory)
        self.peak_allocated = 0
        self.freed_untrimmed = 0          # bytes of buffers freed since the heap was last trimmed

    def handlers(self) -> dict[int, Callable[[int], None]]:
        return {Cmd.DEVICE_COUNT: self.device_count, Cmd.GET_ALIGNMENT: self.get_alignment,
                Cmd.GET_MAX_SIZE: self.get_max_size, Cmd.GET_DEVICE_MEMORY: self.get_device_memory,
                Cmd.GET_ALLOC_SIZE: self.get_alloc_size, Cmd.ALLOC_BUFFER: self.alloc_buffer,
                Cmd.BUFFER_GET_BASE: self.buffer_get_base, Cmd.FREE_BUFFER: self.free_buffer,
                Cmd.BUFFER_CLEAR: self.buffer_clear}

    # --- the device -----------------------------------------------------------------------
    def device_count(self, size: int) -> None:
        self.conn.send(wire.U32.pack(self.conn.state.config.n_devices))

    def get_alignment(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.conn.reader.read(size))
        self.conn.device(dev, "GET_ALIGNMENT")
        self.conn.send(wire.U64.pack(BUFFER_ALIGNMENT))

    def get_max_size(self, size: int) -> None:
        conn = self.conn
        (dev,) = wire.DEV_REQ.unpack(conn.reader.read(size))
        conn.device(dev, "GET_MAX_SIZE")
        with conn.state.turns:
            max_buffer = conn.state.memory.max_buffer()
        conn.send(wire.U64.pack(max_buffer))

    def get_device_memory(self, size: int) -> None:
        conn = self.conn
        (dev,) = wire.DEV_REQ.unpack(conn.reader.read(size))
        conn.device(dev, "GET_DEVICE_MEMORY")
        with conn.state.turns:
            free, total = conn.state.memory.report()
        limit = conn.state.config.session_memory
        if limit is not None:          # what this connection may still allocate, so -fit plans within it
            free = min(free, max(0, limit - self.allocated))
        conn.send(wire.DEVICE_MEMORY_RSP.pack(free, total))

    def get_alloc_size(self, size: int) -> None:
        payload = self.conn.reader.read(size)
        (dev,) = wire.DEV_REQ.unpack_from(payload, 0)
        self.conn.device(dev, "GET_ALLOC_SIZE")
        t = RpcTensor.unpack_from(payload, wire.DEV_REQ.size)
        self.conn.send(wire.U64.pack(nbytes(t, "GET_ALLOC_SIZE")))   # plain host layout: ggml_nbytes

    # --- buffers --------------------------------------------------------------------------
    def alloc_buffer(self, size: int) -> None:
        dev, nbytes_ = wire.ALLOC_BUFFER_REQ.unpack(self.conn.reader.read(size))
        self.conn.device(dev, "ALLOC_BUFFER")
        buf = self.alloc(nbytes_)
        self.conn.send(wire.ALLOC_BUFFER_RSP.pack(buf.handle, buf.size) if buf else wire.ALLOC_BUFFER_RSP.pack(0, 0))

    def alloc(self, n: int) -> RpcBuffer | None:
        """A buffer within this connection's limit and the device budget, or None (the client
        sees an allocation failure, as from the C++ server), with the reason logged."""
        state = self.conn.state
        limit = state.config.session_memory
        if limit is not None and self.allocated + n > limit:
            with state.counting:
                state.sessions.over_session_memory += 1
            log.warning("%s: ALLOC_BUFFER of %d bytes refused: this connection already holds %d bytes of "
                        "buffers, and --session-memory allows %d", self.conn.peer, n, self.allocated, limit)
            return None
        with state.turns:
            buf = self.conn.buffers.alloc(n)
        if buf is not None:
            self.allocated += buf.size
            self.peak_allocated = max(self.peak_allocated, self.allocated)
        return buf

    def buffer_get_base(self, size: int) -> None:
        (handle,) = wire.U64.unpack(self.conn.reader.read(size))
        self.conn.send(wire.U64.pack(self.conn.buffers.get(handle, "BUFFER_GET_BASE").base))

    def free_buffer(self, size: int) -> None:
        (handle,) = wire.U64.unpack(self.conn.reader.read(size))
        with self.conn.state.turns:
            self.conn.buffers.free(handle)
        if self.freed_untrimmed >= TRIM_AFTER_FREED_BYTES:
            self.trim_heap()

    def buffer_clear(self, size: int) -> None:
        handle, value = wire.BUFFER_CLEAR_REQ.unpack(self.conn.reader.read(size))
        buf = self.conn.buffers.get(handle, "BUFFER_CLEAR")
        buf.array.fill(value)
        self.conn.written(buf, 0, buf.size)

    # --- the connection's buffer bytes -----------------------------------------------------
    def freed(self, buf: RpcBuffer) -> None:
        self.allocated -= buf.size
        self.freed_untrimmed += buf.size

    def trim_heap(self) -> None:
        """What the freed buffers' weights and temporaries left in the C heap goes back to the
        system (docs/memory.md "The C library's heap")."""
        self.freed_untrimmed = 0
        return_free_heap()
        with self.conn.state.counting:
            self.conn.state.stats.heap_trims += 1

    def close(self) -> None:
        """After the connection's buffers are freed: trim the heap once more."""
        if self.freed_untrimmed:
            self.trim_heap()
        if self.peak_allocated:
            log.debug("%s held at most %.1f MiB of buffers", self.conn.peer, self.peak_allocated / 2**20)
