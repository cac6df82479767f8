"""The pairwise communicator of protocol 8.0.0 (COMM_INIT / COMM_ALLREDUCE / COMM_FREE): two
servers of one ``-sm tensor`` client sum partial results server to server [docs/ggml-rpc.md §4.6].

Upstream's wire format, so that a pair may mix this server and a C++ one: rank 0 accepts rank 1,
they swap 24 caps bytes (zero: TCP); an all-reduce sends the tensor raw, or as BF16 from 32768
elements, rank 0 first, and each rank adds the peer's copy to its own in f32, in place. Unlike
upstream, whose rank 0 waits in ``accept()`` without a limit, the join is bounded
(``JOIN_TIMEOUT_S``) and every exchange by the stall timeout: a peer that dies or stalls costs
that client its connection, never the server [docs/server.md: COMM_*].

The link has no framing: a byte pending where the protocol leaves the peer nothing to say is a
surplus that would shift every later sum, and ends the link (:func:`_surplus`; docs/server.md).
"""

from __future__ import annotations

import logging
import select
import socket
import time

import numpy as np

log = logging.getLogger("ggml_rknpu.rpc")

CAPS_SIZE = 24                 # RPC_CONN_CAPS_SIZE (transport.h), zero: TCP only
WORLD = 2                      # upstream's communicator is pairwise
CONNECT_TRIES, CONNECT_PAUSE_S = 100, 0.05   # rank 1's retry loop, as upstream's (~5 s)
JOIN_TIMEOUT_S = 10.0          # rank 0's wait for rank 1: longer than upstream's rank 1 retries
BF16_FROM_ELEMENTS = 32768     # F32 tensors of at least this many elements travel as BF16


class CommError(Exception):
    """The peer link failed (refused, died, stalled, or sent something else)."""


def fp32_to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaNs kept quiet."""
    u = x.view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def bf16_to_fp32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view, pos = memoryview(out), 0
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            raise CommError(f"the peer closed the link after {pos} of {n} bytes")
        pos += got
    return bytes(out)


def _surplus(sock: socket.socket) -> bool:
    """A byte is waiting where the peer must be silent (an EOF is not one: the exchange that
    just ended was whole, and the next one sees the close)."""
    ready = select.poll()                   # poll, not a recv: a socket with a timeout waits in recv
    ready.register(sock, select.POLLIN)
    if not ready.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except OSError:                         # a reset: the next exchange reports it
        return False


class PeerLink:
    """One established pairwise link (rank 0 or 1 of 2)."""

    def __init__(self, sock: socket.socket, rank: int, peer: str) -> None:
        self.sock = sock
        self.rank = rank
        self.peer = peer

    @classmethod
    def open(cls, rank: int, world: int, host: str, port: int, listen_host: str, timeout_s: float) -> PeerLink:
        """Join the pair (``timeout_s``: the stall timeout, which also caps the join)."""
        if world != WORLD or rank >= world:
            raise CommError(f"rank {rank} of {world}: the communicator is pairwise (world 2, rank 0 or 1)")
        if not 0 < port < 65536:
            raise CommError(f"port {port}")
        join = min(timeout_s, JOIN_TIMEOUT_S)
        sock = cls._accept(listen_host, port, join) if rank == 0 else cls._connect(host, port, join)
        try:                                               # a peer may reset at any point, even here
            peer = "{}:{}".format(*sock.getpeername()[:2])
            sock.settimeout(timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if rank == 1:                                  # rank 1 sends its caps first
                sock.sendall(bytes(CAPS_SIZE))
                _recv_exact(sock, CAPS_SIZE)
            else:
                _recv_exact(sock, CAPS_SIZE)
            if _surplus(sock):
                raise CommError(f"the peer sent more than its {CAPS_SIZE} caps bytes")
            if rank == 0:
                sock.sendall(bytes(CAPS_SIZE))
        except (OSError, CommError) as exc:
            sock.close()
            raise CommError(f"caps exchange: {exc}") from exc
        return cls(sock, rank, peer)

    @staticmethod
    def _accept(listen_host: str, port: int, timeout_s: float) -> socket.socket:
        family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as listener:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((listen_host, port))
                listener.listen(1)
                listener.settimeout(timeout_s)
                sock, _ = listener.accept()
                return sock
        except OSError as exc:          # TimeoutError included: rank 1 never came
            raise CommError(f"rank 0 waiting on {listen_host}:{port}: {exc}") from exc

    @staticmethod
    def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
        last: OSError | None = None
        deadline = time.monotonic() + timeout_s
        for _ in range(CONNECT_TRIES):
            try:
                return socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            except ValueError as exc:   # UnicodeError: a host name IDNA cannot encode (a label > 63 bytes)
                raise CommError(f"rank 1 connecting to rank 0 at {host!r}: {exc}") from exc
            except OSError as exc:
                last = exc
                if time.monotonic() >= deadline:
                    break
                time.sleep(CONNECT_PAUSE_S)
        raise CommError(f"rank 1 connecting to rank 0 at {host}:{port}: {last}")

    def allreduce(self, values: np.ndarray) -> None:
        """``values`` (f32, contiguous, this server's bytes) += the peer's copy, in place."""
        bf16 = values.size >= BF16_FROM_ELEMENTS
        mine = (fp32_to_bf16(values) if bf16 else values).tobytes()
        what = f"all-reduce of {values.size} elements with {self.peer}"
        try:
            if self.rank == 0:
                if _surplus(self.sock):
                    raise CommError(f"{what}: the peer sent bytes before its turn")
                self.sock.sendall(mine)
                theirs = _recv_exact(self.sock, len(mine))
            else:
                theirs = _recv_exact(self.sock, len(mine))
            if _surplus(self.sock):
                raise CommError(f"{what}: the peer sent more than the {len(mine)} bytes of the tensor")
            if self.rank == 1:
                self.sock.sendall(mine)
        except OSError as exc:          # TimeoutError included: the peer stalled
            raise CommError(f"{what}: {exc}") from exc
        peer = bf16_to_fp32(np.frombuffer(theirs, np.uint16)) if bf16 else np.frombuffer(theirs, np.float32)
        with np.errstate(over="ignore", invalid="ignore"):   # an inf or NaN partial sum is the model's, as in ggml
            np.add(values, peer, out=values)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

