"""What ggml RPC protocol 8.0.0 adds to a connection: graphs by uid, strided tensor I/O, COMM_*.

8.0.0 is upstream PR #26610 (llama.cpp b11458 on) [docs/ggml-rpc.md §4]. Its client replays a
graph it has sent with a 12-byte GRAPH_RECOMPUTE ``{dev, uid}``, and a uid the server lacks ends
the connection, so :class:`UidGraphs` mirrors the client's rule exactly (uid 0 never stored;
cleared at 1024 uids, before the insert; FREE_BUFFER drops the graphs but keeps the uids) and
never evicts on its own. A stored uid keeps the graph's payload (7.0.0 layout, shared between
identical payloads) and its digest; a replay runs the plan cached for that digest, rebuilt from
the payload if needed. COMM_* is ``comm.py``'s pairwise communicator (docs/server.md).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ggml_rknpu.libggml.enums import GgmlType
from ggml_rknpu.server.buffers import RpcBuffer
from ggml_rknpu.server.ops.geometry import contiguous_nb
from ggml_rknpu.server.plan_cache import graph_digest
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.comm import CommError, PeerLink
from ggml_rknpu.server.rpc.connection import Connection
from ggml_rknpu.server.rpc.wire import Cmd, ProtocolError
from ggml_rknpu.server.tensor import CheckedTensor

log = logging.getLogger("ggml_rknpu.rpc")


GRAPH_HEAD = struct.Struct("<IQI")          # dev, uid, n_nodes; then as in 7.0.0
RECOMPUTE_REQ = struct.Struct("<IQ")        # dev, uid (12 bytes, packed)
TENSOR_2D_TAIL = struct.Struct("<QQQQ")     # after T: offset, size, n_copies, stride
COMM_INIT_REQ = struct.Struct("<IIII64s")   # dev, rank, world, port, host
assert GRAPH_HEAD.size == wire.GRAPH_HEAD_8_SIZE
assert RECOMPUTE_REQ.size == wire.FIXED_PAYLOAD_8[Cmd.GRAPH_RECOMPUTE]
assert wire.RPC_TENSOR_SIZE + TENSOR_2D_TAIL.size == wire.TENSOR_2D_HEADER_SIZE
assert COMM_INIT_REQ.size == wire.FIXED_PAYLOAD_8[Cmd.COMM_INIT]

GRAPH_CACHE_MAX = 1024         # GRAPH_CACHE_MAX of both sides: they must clear at the same point
# Stored graph payloads of one connection (distinct bytes only). The C++ server keeps up to 1024
# graphs per device too; past this a client is refused rather than let it exhaust host memory.
MAX_STORED_GRAPH_BYTES = 1 << 30


def split_uid(payload: bytes) -> tuple[int, int, bytes]:
    """(dev, uid, the same graph in 7.0.0 layout) of an 8.0.0 GRAPH_COMPUTE payload."""
    dev, uid, _ = GRAPH_HEAD.unpack_from(payload, 0)
    return dev, uid, payload[:4] + payload[12:]


@dataclass(slots=True)
class StoredGraph:
    digest: bytes
    payload: bytes | None     # None: dropped by FREE_BUFFER (the uid stays, as in the C++ server)


@dataclass
class UidGraphs:
    """One device's graphs by uid, kept exactly as long as the client believes them stored."""

    by_uid: dict[int, StoredGraph] = field(default_factory=dict)
    payloads: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)   # digest -> (payload, uids)
    stored_bytes: int = 0

    def store(self, uid: int, digest: bytes, payload: bytes) -> None:
        if uid == 0:
            return
        if len(self.by_uid) >= GRAPH_CACHE_MAX:
            self.clear()
        old = self.by_uid.pop(uid, None)
        if old is not None:
            self._release(old)
        shared, users = self.payloads.get(digest, (payload, 0))
        if users == 0:
            if self.stored_bytes + len(payload) > MAX_STORED_GRAPH_BYTES:
                raise ProtocolError(f"GRAPH_COMPUTE uid {uid}: the stored graphs of this connection would exceed "
                                    f"{MAX_STORED_GRAPH_BYTES >> 20} MiB")
            self.stored_bytes += len(payload)
        self.payloads[digest] = (shared, users + 1)
        self.by_uid[uid] = StoredGraph(digest, shared)

    def find(self, dev: int, uid: int) -> StoredGraph:
        stored = self.by_uid.get(uid)
        if stored is None:
            raise ProtocolError(f"GRAPH_RECOMPUTE: device {dev}, graph with uid {uid} not found")
        if stored.payload is None:
            raise ProtocolError(f"GRAPH_RECOMPUTE: device {dev}, graph with uid {uid} was dropped when a "
                                f"buffer was freed")
        return stored

    def drop_graphs(self) -> None:
        """FREE_BUFFER: forget every graph, keep the uids (the count stays in step with the client)."""
        for stored in self.by_uid.values():
            stored.payload = None
        self.payloads.clear()
        self.stored_bytes = 0

    def clear(self) -> None:
        self.by_uid.clear()
        self.payloads.clear()
        self.stored_bytes = 0

    def _release(self, stored: StoredGraph) -> None:
        if stored.payload is None:
            return
        payload, users = self.payloads[stored.digest]
        if users > 1:
            self.payloads[stored.digest] = (payload, users - 1)
        else:
            del self.payloads[stored.digest]
            self.stored_bytes -= len(payload)


@dataclass(frozen=True, slots=True)
class Rows:
    """``n_copies`` rows of ``size`` bytes, ``stride`` apart in the buffer, packed on the wire."""

    tensor: CheckedTensor
    buffer: RpcBuffer    # the buffer the tensor lies in
    first: int              # buffer offsets of the first row's start and the last row's end
    end: int
    size: int
    n_copies: int
    stride: int

    @property
    def wire_bytes(self) -> int:
        return self.size * self.n_copies

    def starts(self) -> list[int]:
        return [self.first + i * self.stride for i in range(self.n_copies)]


class Proto8:
    """The 8.0.0 command handlers of one session (which keeps everything 7.0.0 has)."""

    def __init__(self, session: Connection) -> None:
        self.s = session
        self.uids = [UidGraphs() for _ in range(session.state.config.n_devices)]
        self.links: dict[int, PeerLink] = {}                # device -> its pairwise communicator

    def handlers(self) -> dict[int, Callable[[int], None]]:
        return {Cmd.GRAPH_COMPUTE: self.graph_compute, Cmd.GRAPH_RECOMPUTE: self.graph_recompute,
                Cmd.SET_TENSOR_2D: self.set_tensor_2d, Cmd.GET_TENSOR_2D: self.get_tensor_2d,
                Cmd.COMM_INIT: self.comm_init, Cmd.COMM_ALLREDUCE: self.comm_allreduce,
                Cmd.COMM_FREE: self.comm_free}

    def on_free(self) -> None:
        for u in self.uids:
            u.drop_graphs()

    def close(self) -> None:
        for u in self.uids:
            u.clear()
        for link in self.links.values():
            link.close()
        self.links.clear()

    # --- graphs ---------------------------------------------------------------------------
    def graph_compute(self, size: int) -> None:
        dev, uid, payload = split_uid(self.s.reader.read(size))
        self.s.device(dev, "GRAPH_COMPUTE")
        digest = graph_digest(payload)
        self.s.compute_graph(dev, payload, digest)    # validated and run before it is stored
        self.uids[dev].store(uid, digest, payload)

    def graph_recompute(self, size: int) -> None:
        dev, uid = RECOMPUTE_REQ.unpack(self.s.reader.read(size))
        stored = self.uids[self.s.device(dev, "GRAPH_RECOMPUTE")].find(dev, uid)
        assert stored.payload is not None
        self.s.state.stats.recomputes += 1
        self.s.compute_graph(dev, stored.payload, stored.digest, replay=True)

    # --- strided tensor I/O ---------------------------------------------------------------
    def _rows(self, payload: bytes, what: str) -> Rows:
        t, buf = self.s.target(payload, 0, what)
        offset, row, n_copies, stride = TENSOR_2D_TAIL.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        name = f"{what} '{t.rpc.name}'"
        if row == 0 or n_copies == 0:
            raise ProtocolError(f"{name}: empty rows (size {row}, n_copies {n_copies})")
        span = (n_copies - 1) * stride + row
        tensor_bytes = t.end - t.start
        if offset > tensor_bytes or span > tensor_bytes - offset:
            raise ProtocolError(f"{name}: {n_copies} rows of {row} bytes every {stride} from +{offset} exceed the "
                                f"tensor's {tensor_bytes} bytes")
        if row * n_copies > buf.size:          # overlapping rows (stride < size) could amplify a read
            raise ProtocolError(f"{name}: {row * n_copies} bytes of rows exceed the whole buffer ({buf.size})")
        first, end = buf.span(t.rpc.data + offset, span, name)
        return Rows(t, buf, first, end, row, n_copies, stride)

    def set_tensor_2d(self, size: int) -> None:
        rows = self._rows(self.s.reader.read(wire.TENSOR_2D_HEADER_SIZE), "SET_TENSOR_2D")
        t = rows.tensor
        if size != wire.TENSOR_2D_HEADER_SIZE + rows.wire_bytes:
            raise ProtocolError(f"SET_TENSOR_2D '{t.rpc.name}': payload is {size} bytes, {rows.n_copies} rows of "
                                f"{rows.size} need {wire.TENSOR_2D_HEADER_SIZE + rows.wire_bytes}")
        target = memoryview(rows.buffer.array.data)
        if rows.stride == rows.size:                 # packed on the server too: one read
            self.s.reader.read_into(target[rows.first:rows.end])
        else:
            for start in rows.starts():
                self.s.reader.read_into(target[start:start + rows.size])
        self.s.written(rows.buffer, rows.first, rows.end)

    def get_tensor_2d(self, size: int) -> None:
        rows = self._rows(self.s.reader.read(size), "GET_TENSOR_2D")
        data = rows.buffer.array
        if rows.stride == rows.size:
            self.s.send(data[rows.first:rows.end].tobytes())
        else:
            self.s.send(b"".join(data[start:start + rows.size].tobytes() for start in rows.starts()))

    # --- server-to-server all-reduce --------------------------------------------------------
    def comm_init(self, size: int) -> None:
        dev, rank, world, port, raw_host = COMM_INIT_REQ.unpack(self.s.reader.read(size))
        self.s.device(dev, "COMM_INIT")
        if dev in self.links:                              # upstream: a device with a peer answers 1 at once
            self.s.send(wire.U8.pack(1))
            return
        host = wire.tensor_name(raw_host)
        try:
            link = PeerLink.open(rank, world, host, port, self.s.sock.getsockname()[0],
                                 self.s.state.config.stall_timeout_s)
        except CommError as exc:
            log.warning("%s: COMM_INIT refused (the client falls back to tensor copies): %s", self.s.peer, exc)
            self.s.send(wire.U8.pack(0))
            return
        self.links[dev] = link
        log.info("%s: device %d joined a pairwise communicator as rank %d with %s", self.s.peer, dev, rank, link.peer)
        self.s.send(wire.U8.pack(1))

    def comm_allreduce(self, size: int) -> None:
        payload = self.s.reader.read(size)
        (dev,) = wire.DEV_REQ.unpack_from(payload, 0)
        self.s.device(dev, "COMM_ALLREDUCE")
        t, buf = self.s.target(payload, wire.DEV_REQ.size, "COMM_ALLREDUCE")
        link = self.links.get(dev)
        if link is None:
            raise ProtocolError(f"COMM_ALLREDUCE on device {dev} without a communicator (no COMM_INIT answered 1)")
        r = t.rpc
        n = r.ne[0] * r.ne[1] * r.ne[2] * r.ne[3]
        if r.type != GgmlType.F32 or tuple(r.nb) != contiguous_nb(r.type, r.ne):
            raise ProtocolError(f"COMM_ALLREDUCE '{r.name}': only contiguous F32 tensors are summed "
                                f"(type {r.type}, nb {r.nb})")
        values = buf.array[t.start:t.end].view(np.float32)
        assert values.size == n
        try:
            link.allreduce(values)
        except CommError as exc:
            del self.links[dev]
            link.close()
            raise ProtocolError(f"COMM_ALLREDUCE '{r.name}': {exc}; the peer link is dropped") from exc
        self.s.written(buf, t.start, t.end)

    def comm_free(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.s.reader.read(size))
        self.s.device(dev, "COMM_FREE")
        link = self.links.pop(dev, None)
        if link is not None:
            link.close()
