"""Record a real client's RPC session through a TCP proxy, then replay its requests against another
server and compare every reply.

The proxy sits between a llama.cpp client and a reference server (the C++ ``ggml-rpc-server``)
and keeps each connection's two byte streams. ``messages`` cuts the request stream at the
framing (u8 cmd | u64 size | payload) and pairs every command that has a reply with its reply.
``replay`` sends the same requests to the server under test, one connection after another as
the client made them, translating the reference server's buffer handles and addresses into the
ones the tested server returned (every ``rpc_tensor`` and handle field the protocol has), and
returns both replies of every command for the caller to compare.
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field

from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd

# Commands of protocol 8.0.0 with a reply [docs/ggml-rpc.md §4.2]
REPLIES = {Cmd.ALLOC_BUFFER, Cmd.GET_ALIGNMENT, Cmd.GET_MAX_SIZE, Cmd.BUFFER_GET_BASE, Cmd.SET_TENSOR_HASH,
           Cmd.GET_TENSOR, Cmd.COPY_TENSOR, Cmd.GET_DEVICE_MEMORY, Cmd.GET_ALLOC_SIZE, Cmd.HELLO,
           Cmd.DEVICE_COUNT, Cmd.GET_TENSOR_2D, Cmd.COMM_INIT}
T = wire.RPC_TENSOR_SIZE
# Where each command carries rpc_tensors (offsets into its payload), for address translation
_TENSORS_AT: dict[int, tuple[int, ...]] = {
    Cmd.SET_TENSOR: (0,), Cmd.SET_TENSOR_HASH: (0,), Cmd.GET_TENSOR: (0,), Cmd.COPY_TENSOR: (0, T),
    Cmd.INIT_TENSOR: (0,), Cmd.GET_ALLOC_SIZE: tuple(4 + i * T for i in range(1 + wire.GGML_MAX_SRC)),
    Cmd.MEMSET_TENSOR: (0,), Cmd.SET_TENSOR_2D: (0,), Cmd.GET_TENSOR_2D: (0,), Cmd.COMM_ALLREDUCE: (4,),
}
_HANDLE_FIRST = {Cmd.BUFFER_GET_BASE, Cmd.FREE_BUFFER, Cmd.BUFFER_CLEAR}   # payload starts with a handle


@dataclass
class Connection:
    requests: bytearray = field(default_factory=bytearray)
    replies: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True)
class Message:
    cmd: int
    payload: bytes
    reply: bytes | None       # the reference server's reply payload (None: a command without one)


class RecordingProxy:
    """Forwards every connection on ``port`` to ``target_port`` on loopback, keeping both streams."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[Connection] = []
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            conn = Connection()
            self.connections.append(conn)
            for src, dst, keep in ((client, upstream, conn.requests), (upstream, client, conn.replies)):
                th = threading.Thread(target=_pump, args=(src, dst, keep), daemon=True)
                th.start()
                self._threads.append(th)

    def close(self) -> None:
        self.listener.close()
        for th in self._threads:
            th.join(timeout=30)


def _pump(src: socket.socket, dst: socket.socket, keep: bytearray) -> None:
    try:
        while chunk := src.recv(1 << 16):
            keep += chunk
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def messages(conn: Connection) -> list[Message]:
    """The connection's requests, each with the reference server's reply where it has one."""
    out, pos, rpos = [], 0, 0
    req, rep = bytes(conn.requests), bytes(conn.replies)
    while pos + wire.REQUEST_HEADER.size <= len(req):
        cmd, size = wire.REQUEST_HEADER.unpack_from(req, pos)
        pos += wire.REQUEST_HEADER.size
        payload = req[pos:pos + size]
        pos += size
        reply = None
        if cmd in REPLIES and rpos + 8 <= len(rep):
            (n,) = struct.unpack_from("<Q", rep, rpos)
            reply = rep[rpos + 8:rpos + 8 + n]
            rpos += 8 + n
        out.append(Message(cmd, payload, reply))
    return out


class AddressMap:
    """Reference server's buffer handles and addresses -> the tested server's."""

    def __init__(self) -> None:
        self.handles: dict[int, int] = {0: 0}
        self.bases: list[tuple[int, int, int]] = []      # (reference base, size, tested base)
        self.sizes: dict[int, int] = {}                  # reference handle -> size

    def address(self, addr: int) -> int:
        for ref, size, ours in self.bases:
            if ref <= addr <= ref + size:
                return ours + (addr - ref)
        return addr

    def tensor(self, raw: bytearray, at: int) -> None:
        buffer, = struct.unpack_from("<Q", raw, at + 12)
        data, = struct.unpack_from("<Q", raw, at + 220)
        struct.pack_into("<Q", raw, at + 12, self.handles.get(buffer, buffer))
        if data:
            struct.pack_into("<Q", raw, at + 220, self.address(data))

    def request(self, cmd: int, payload: bytes) -> bytes:
        raw = bytearray(payload)
        if cmd in _HANDLE_FIRST:
            handle, = struct.unpack_from("<Q", raw, 0)
            struct.pack_into("<Q", raw, 0, self.handles.get(handle, handle))
        for at in _TENSORS_AT.get(cmd, ()):
            self.tensor(raw, at)
        if cmd == Cmd.GRAPH_COMPUTE:
            n_nodes, = struct.unpack_from("<I", raw, 12)
            pos = 16 + 8 * n_nodes
            n_tensors, = struct.unpack_from("<I", raw, pos)
            for i in range(n_tensors):
                self.tensor(raw, pos + 4 + i * T)
        return bytes(raw)


@dataclass(frozen=True)
class Exchange:
    cmd: int
    request: bytes          # as sent to the tested server
    reference: bytes
    tested: bytes


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"the tested server closed the connection after {len(out)}/{n} bytes")
        out += chunk
    return bytes(out)


def replay(connections: list[list[Message]], port: int, timeout: float = 300.0) -> list[Exchange]:
    """Send every recorded request to the server on ``port``; return every pair of replies."""
    out: list[Exchange] = []
    for msgs in connections:
        amap = AddressMap()
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            pending_base: dict[int, int] = {}
            for m in msgs:
                request = amap.request(m.cmd, m.payload)
                sock.sendall(wire.pack_request(m.cmd, request))
                if m.cmd not in REPLIES or m.reply is None:
                    continue
                (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
                tested = _recv_exact(sock, n)
                out.append(Exchange(m.cmd, request, m.reply, tested))
                if m.cmd == Cmd.ALLOC_BUFFER and len(tested) == 16 and len(m.reply) == 16:
                    ref_handle, ref_size = struct.unpack("<QQ", m.reply)
                    amap.handles[ref_handle] = struct.unpack("<Q", tested[:8])[0]
                    amap.sizes[ref_handle] = ref_size
                    pending_base[amap.handles[ref_handle]] = ref_handle
                elif m.cmd == Cmd.BUFFER_GET_BASE and len(tested) == 8:
                    ours, = struct.unpack_from("<Q", request, 0)
                    ref_handle = pending_base.get(ours)
                    if ref_handle is not None:
                        amap.bases.append((struct.unpack("<Q", m.reply)[0], amap.sizes[ref_handle],
                                           struct.unpack("<Q", tested)[0]))
    return out
