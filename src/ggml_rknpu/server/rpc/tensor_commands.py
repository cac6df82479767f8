"""The tensor data commands of a connection: SET_TENSOR (its payload read straight into the
buffer), SET_TENSOR_HASH (the disk cache, ``tensor_cache``), GET_TENSOR, MEMSET_TENSOR,
COPY_TENSOR and INIT_TENSOR. Every one checks its tensor against the connection's buffers and
reports what it wrote (``Connection.written``)."""

from __future__ import annotations

from collections.abc import Callable

from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.connection import Connection
from ggml_rknpu.server.rpc.deadlines import RECV_CHUNK
from ggml_rknpu.server.rpc.tensor_cache import TensorCache
from ggml_rknpu.server.rpc.wire import Cmd


class TensorCommands:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        directory = conn.state.config.cache_dir
        self.cache = TensorCache(directory) if directory is not None else None

    def handlers(self) -> dict[int, Callable[[int], None]]:
        return {Cmd.SET_TENSOR: self.set_tensor, Cmd.SET_TENSOR_HASH: self.set_tensor_hash,
                Cmd.GET_TENSOR: self.get_tensor, Cmd.MEMSET_TENSOR: self.memset_tensor,
                Cmd.COPY_TENSOR: self.copy_tensor, Cmd.INIT_TENSOR: self.init_tensor}

    def set_tensor(self, size: int) -> None:
        conn = self.conn
        header = conn.reader.read(wire.SET_TENSOR_HEADER_SIZE)
        t, buf = conn.target(header, 0, "SET_TENSOR")
        cache_flag, offset = wire.SET_TENSOR_TAIL.unpack_from(header, wire.RPC_TENSOR_SIZE)
        n = size - wire.SET_TENSOR_HEADER_SIZE
        start, end = buf.span(t.rpc.data + offset, n, f"SET_TENSOR '{t.rpc.name}' at +{offset}")
        conn.reader.read_into(buf.array.data[start:end])
        conn.written(buf, start, end)
        if cache_flag and self.cache is not None:
            self.cache.store(buf, t.rpc.data + offset, start, end)

    def set_tensor_hash(self, size: int) -> None:
        """Answers 1 if the bytes with this FNV-1a-64 hash are in the cache (and now in the tensor)."""
        conn = self.conn
        payload = conn.reader.read(size)
        t, buf = conn.target(payload, 0, "SET_TENSOR_HASH")
        offset, digest = wire.TENSOR_OFFSET_U64.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        span = None
        if self.cache is not None:
            span = self.cache.load(buf, t.rpc.data + offset, digest, f"SET_TENSOR_HASH '{t.rpc.name}' at +{offset}")
        if span is not None:
            conn.written(buf, *span)
        conn.send(wire.U8.pack(int(span is not None)))

    def get_tensor(self, size: int) -> None:
        conn = self.conn
        payload = conn.reader.read(size)
        t, buf = conn.target(payload, 0, "GET_TENSOR")
        offset, n = wire.TENSOR_OFFSET_U64.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        start, end = buf.span(t.rpc.data + offset, n, f"GET_TENSOR '{t.rpc.name}' at +{offset}")
        data = buf.array.data[start:end]
        if n <= RECV_CHUNK:                      # one segment for the per-token logits read
            conn.deadlines.send(wire.RESPONSE_HEADER.pack(n) + data.tobytes())
        else:
            conn.deadlines.send(wire.RESPONSE_HEADER.pack(n), data)
        conn.count_out(n + 8)

    def memset_tensor(self, size: int) -> None:
        conn = self.conn
        payload = conn.reader.read(size)
        t, buf = conn.target(payload, 0, "MEMSET_TENSOR")
        offset, n, value = wire.MEMSET_TAIL.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        start, end = buf.span(t.rpc.data + offset, n, f"MEMSET_TENSOR '{t.rpc.name}' at +{offset}")
        buf.array[start:end] = value
        conn.written(buf, start, end)

    def copy_tensor(self, size: int) -> None:
        conn = self.conn
        payload = conn.reader.read(size)
        src, src_buf = conn.target(payload, 0, "COPY_TENSOR src")
        dst, dst_buf = conn.target(payload, wire.RPC_TENSOR_SIZE, "COPY_TENSOR dst")
        n = src.end - src.start
        start, end = dst_buf.span(dst.rpc.data, n, f"COPY_TENSOR of {n} bytes into '{dst.rpc.name}'")
        dst_buf.array[start:end] = src_buf.array[src.start:src.end]   # numpy handles overlap
        conn.written(dst_buf, start, end)
        conn.send(wire.U8.pack(1))

    def init_tensor(self, size: int) -> None:
        payload = self.conn.reader.read(size)
        self.conn.target(payload, 0, "INIT_TENSOR")   # validated; host buffers need no per-tensor init
