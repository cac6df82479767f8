"""Test helpers for the RPC server: a wire-level Python client, a server in a thread and
a fake NPU engine (the ``MatmulEngine`` protocol of engine/contract.py).

The fake engine exists so protocol, planning and residency tests do not depend on the
simulator's speed; host ops are the real ggml-cpu (libggml).
"""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from ggml_rknpu.engine.contract import OneMatmul
from ggml_rknpu.libggml.abi import GGML_TENSOR_FLAG_COMPUTE
from ggml_rknpu.libggml.enums import GgmlType
from ggml_rknpu.server.buffers import DeviceBudget
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.config import ServerConfig
from ggml_rknpu.server.rpc.listener import RpcServer
from ggml_rknpu.server.rpc.state import ServerState
from ggml_rknpu.server.rpc.wire import Cmd

F32 = int(GgmlType.F32)
GIB = 1 << 30


# --- fake engine ----------------------------------------------------------------------------
class FakeWeight:
    def __init__(self, engine: FakeNpu, b: np.ndarray, dtype: str) -> None:
        self.engine = engine
        self.b = b.astype(np.float16).astype(np.float32) if dtype == "fp16" else b.astype(np.float32)
        self.shape: tuple[int, int] = b.shape
        self.dtype = dtype
        self.packed_bytes = b.size * (2 if dtype == "fp16" else 1)
        self.freed = False

    def free(self) -> None:
        self.freed = True
        self.engine.frees += 1


MATMUL_DEVICE_S = 1e-3    # what a FakeNpu.matmul reports as its device time
FUSION_DEVICE_S = 0.25e-3   # what a FakeFusion run reports as its device time (FakeNpu.matmul: 1 ms)


class FakeNpu:
    """A ``MatmulEngine`` (engine/contract.py) computing on the host, with counters."""

    def __init__(self, budget: tuple[int, int] = (3 * GIB, 4 * GIB)) -> None:
        self.budget = budget
        self.counters: dict[str, int] = {}
        self.last_timing: SimpleNamespace | None = None
        self.uploads = 0
        self.frees = 0
        self.matmuls = 0
        self.fail_matmul = False

    def upload_weight(self, b: np.ndarray, dtype: str = "fp16") -> FakeWeight:
        assert b.dtype == np.float32 and b.ndim == 2
        self.uploads += 1
        return FakeWeight(self, b, dtype)

    def describe(self) -> str:
        return "fake engine (host numpy)"

    def matmul(self, a: np.ndarray, w: FakeWeight, *, out: str | None = None) -> np.ndarray:
        assert not w.freed, "matmul with a freed (stale) weight"
        if self.fail_matmul:
            raise RuntimeError("injected NPU fault")
        self.matmuls += 1
        self.last_timing = SimpleNamespace(device_s=MATMUL_DEVICE_S, device_label="modeled")
        return a.astype(np.float32) @ w.b.T

    def memory_budget(self) -> tuple[int, int]:
        return self.budget

    def reset(self) -> list | None:
        return None        # no reset (``FaultyNpu`` has one)

    def close(self) -> None:
        pass


class FakeFusion:
    """``FusingFakeNpu.fuse``: the members' matmuls, one ``submits`` count per run."""

    def __init__(self, engine: FusingFakeNpu, weights: list[FakeWeight], m: int) -> None:
        self.engine, self.weights, self.m, self.closed = engine, weights, m, False

    def run(self, a: np.ndarray, outs=None) -> list[np.ndarray]:
        assert not self.closed and not any(w.freed for w in self.weights), "run of a stale fusion"
        assert a.shape[0] <= self.m
        if self.engine.fail_fusion:
            raise RuntimeError("injected fault in a chained submit")
        self.engine.counters["submits"] = self.engine.counters.get("submits", 0) + 1
        # one submit's device time, apart from a lone matmul's 1 ms so that tests can tell them apart
        self.engine.last_timing = SimpleNamespace(device_s=FUSION_DEVICE_S, device_label="modeled")
        results = [a.astype(np.float32) @ w.b.T for w in self.weights]
        for dst, r in zip(outs, results):
            dst[...] = r
        return results

    def close(self) -> None:
        self.closed = True


class FusingFakeNpu(FakeNpu):
    """A FakeNpu that also plans fusions (``engine.contract.FusingEngine``); ``fusions_built``
    counts those of several weights (one weight is its matmul)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fusions_built = 0
        self.fail_fusion = False
        self.refuse_fusions = False

    def fuse(self, weights: list[FakeWeight], m: int = 1, *, out: str | None = None) -> FakeFusion | OneMatmul:
        if len(weights) == 1:
            return OneMatmul(self, weights[0])  # type: ignore[arg-type]  # one weight: the fake's matmul
        if self.refuse_fusions:
            raise ValueError("too many tasks for one chain (injected)")
        self.fusions_built += 1
        return FakeFusion(self, list(weights), m)



class FaultyNpu(FakeNpu):
    """FakeNpu whose matmuls raise the queued faults first; ``reset`` optionally loses weights."""

    def __init__(self, faults=(), reset_loses_weights=False) -> None:
        super().__init__()
        self.faults = list(faults)
        self.resets = 0
        self.reset_loses_weights = reset_loses_weights
        self.live: list = []

    def upload_weight(self, b, dtype="fp16"):
        w = super().upload_weight(b, dtype)
        self.live.append(w)
        return w

    def matmul(self, a, w, *, out=None):
        if self.faults:
            raise self.faults.pop(0)
        return super().matmul(a, w, out=out)

    def reset(self):
        self.resets += 1
        if not self.reset_loses_weights:
            return []
        lost, self.live = self.live, []
        for w in lost:
            w.freed = True
        return lost


# --- tensors and graphs ------------------------------------------------------------------------
_ids = iter(range(0x1000, 1 << 40, 0x10))


@dataclass
class T:
    """A client-side tensor description (what llama.cpp would serialize)."""

    ne: tuple[int, int, int, int]
    buffer: int
    data: int
    type: int = F32
    nb: tuple[int, int, int, int] | None = None
    op: int = 0
    src: tuple[int, ...] = ()
    view_src: int = 0
    view_offs: int = 0
    flags: int | None = None         # default: what ggml_build_forward_expand gives a node (COMPUTE)
    op_params: tuple[int, ...] = ()
    name: str = ""
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        if self.flags is None:
            self.flags = GGML_TENSOR_FLAG_COMPUTE if self.op else 0
        if self.nb is None:
            from ggml_rknpu.libggml.enums import TYPE_TRAITS
            block, size = TYPE_TRAITS[GgmlType(self.type)]
            nb0, nb1 = size, size * (self.ne[0] // block)
            self.nb = (nb0, nb1, nb1 * self.ne[1], nb1 * self.ne[1] * self.ne[2])

    def _filled(self) -> tuple[tuple[int, int, int, int], int]:
        """``nb`` and ``flags`` as ``__post_init__`` filled them in."""
        assert self.nb is not None and self.flags is not None, "set by __post_init__"
        return self.nb, self.flags

    @property
    def nbytes(self) -> int:
        return self._filled()[0][3] * self.ne[3]

    def pack(self) -> bytes:
        nb, flags = self._filled()
        return wire.pack_tensor(id=self.id, type=self.type, buffer=self.buffer, ne=self.ne, nb=nb,
                                data=self.data, op=self.op, op_params=self.op_params, flags=flags,
                                src=self.src, view_src=self.view_src, view_offs=self.view_offs, name=self.name)


def graph_payload(nodes: list[T], tensors: list[T], dev: int = 0, uid: int | None = None) -> bytes:
    """GRAPH_COMPUTE payload: 7.0.0 layout, or 8.0.0 (a graph uid after ``dev``) when ``uid`` is given."""
    head = struct.pack("<I", dev) + (b"" if uid is None else struct.pack("<Q", uid))
    return (head + struct.pack("<I", len(nodes)) + b"".join(struct.pack("<Q", n.id) for n in nodes)
            + struct.pack("<I", len(tensors)) + b"".join(t.pack() for t in tensors))


# --- client -----------------------------------------------------------------------------------
_OPEN_CLIENTS: weakref.WeakSet[RpcClient] = weakref.WeakSet()   # RpcClients not closed yet


class ServerClosed(Exception):
    pass


class RpcClient:
    """Speaks the wire format; every call checks the reply size like the C++ client does."""

    def __init__(self, port: int, hello: bool = True, timeout: float = 10.0, major: int = 7,
                 rcvbuf: int | None = None) -> None:
        """``rcvbuf``: SO_RCVBUF set before connecting (a reader that the server's replies wait
        for, instead of the kernel's autotuned megabytes)."""
        self.major = major
        self.port = port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(("127.0.0.1", port))
        except OSError:
            self.sock.close()
            raise
        _OPEN_CLIENTS.add(self)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hello:
            assert self.hello() == wire.PROTO_VERSIONS[major]

    def close(self) -> None:
        _OPEN_CLIENTS.discard(self)
        self.sock.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, cmd: int, payload: bytes = b"") -> None:
        self.sock.sendall(wire.pack_request(cmd, payload))

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ServerClosed(f"server closed after {len(out)}/{n} bytes")
            out += chunk
        return bytes(out)

    def reply(self, expect: int | None = None) -> bytes:
        (n,) = struct.unpack("<Q", self.recv_exact(8))
        if expect is not None:
            assert n == expect, f"reply of {n} bytes, expected {expect}"
        return self.recv_exact(n)

    def call(self, cmd: int, payload: bytes = b"", expect: int | None = None) -> bytes:
        self.send(cmd, payload)
        return self.reply(expect)

    def is_closed_by_server(self, timeout: float = 5.0) -> bool:
        """True once the server has closed (EOF or reset), False if it is still talking."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    # commands
    def hello(self) -> tuple[int, int, int]:
        major, minor, patch = self.call(Cmd.HELLO, bytes(24), expect=28)[:3]
        return major, minor, patch

    def device_count(self) -> int:
        return struct.unpack("<I", self.call(Cmd.DEVICE_COUNT, b"", expect=4))[0]

    def alloc(self, size: int, dev: int = 0) -> tuple[int, int]:
        return struct.unpack("<QQ", self.call(Cmd.ALLOC_BUFFER, struct.pack("<IQ", dev, size), expect=16))

    def base(self, handle: int) -> int:
        return struct.unpack("<Q", self.call(Cmd.BUFFER_GET_BASE, struct.pack("<Q", handle), expect=8))[0]

    def alloc_base(self, size: int) -> tuple[int, int]:
        handle, got = self.alloc(size)
        assert handle != 0 and got == size
        return handle, self.base(handle)

    def alignment(self, dev: int = 0) -> int:
        return struct.unpack("<Q", self.call(Cmd.GET_ALIGNMENT, struct.pack("<I", dev), expect=8))[0]

    def max_size(self, dev: int = 0) -> int:
        return struct.unpack("<Q", self.call(Cmd.GET_MAX_SIZE, struct.pack("<I", dev), expect=8))[0]

    def device_memory(self, dev: int = 0) -> tuple[int, int]:
        return struct.unpack("<QQ", self.call(Cmd.GET_DEVICE_MEMORY, struct.pack("<I", dev), expect=16))

    def free(self, handle: int) -> None:
        self.send(Cmd.FREE_BUFFER, struct.pack("<Q", handle))

    def clear(self, handle: int, value: int) -> None:
        self.send(Cmd.BUFFER_CLEAR, struct.pack("<QB", handle, value))

    def set_tensor(self, t: T, data: bytes, offset: int = 0, cache_flag: int = 0) -> None:
        self.send(Cmd.SET_TENSOR, t.pack() + struct.pack("<BQ", cache_flag, offset) + data)

    def set_array(self, t: T, arr: np.ndarray) -> None:
        self.set_tensor(t, np.ascontiguousarray(arr).tobytes())

    def set_tensor_hash(self, t: T, digest: int, offset: int = 0) -> int:
        return self.call(Cmd.SET_TENSOR_HASH, t.pack() + struct.pack("<QQ", offset, digest), expect=1)[0]

    def get_tensor(self, t: T, offset: int = 0, size: int | None = None) -> bytes:
        size = t.nbytes if size is None else size
        return self.call(Cmd.GET_TENSOR, t.pack() + struct.pack("<QQ", offset, size), expect=size)

    def get_array(self, t: T, dtype=np.float32) -> np.ndarray:
        shape = t.ne[::-1]
        outer = tuple(n for n in shape[:2] if n != 1)          # drop unit batch dims: [ne1, ne0] for 2-D
        return np.frombuffer(self.get_tensor(t), dtype=dtype).reshape(outer + shape[2:])

    def copy_tensor(self, src: T, dst: T) -> int:
        return self.call(Cmd.COPY_TENSOR, src.pack() + dst.pack(), expect=1)[0]

    def memset(self, t: T, offset: int, size: int, value: int) -> None:
        self.send(Cmd.MEMSET_TENSOR, t.pack() + struct.pack("<QQB", offset, size, value))

    def init_tensor(self, t: T) -> None:
        self.send(Cmd.INIT_TENSOR, t.pack())

    def alloc_size(self, t: T, dev: int = 0) -> int:
        payload = struct.pack("<I", dev) + t.pack() + bytes(wire.RPC_TENSOR_SIZE * 10)
        return struct.unpack("<Q", self.call(Cmd.GET_ALLOC_SIZE, payload, expect=8))[0]

    def graph_compute(self, nodes: list[T], tensors: list[T], dev: int = 0, uid: int = 0) -> None:
        """``uid``: the graph's uid on a protocol-8 connection (0 = a graph without identity)."""
        self.send(Cmd.GRAPH_COMPUTE, graph_payload(nodes, tensors, dev, uid if self.major == 8 else None))

    def graph_recompute(self, dev: int = 0, uid: int | None = None) -> None:
        payload = struct.pack("<I", dev) if self.major == 7 else struct.pack("<IQ", dev, uid or 0)
        self.send(Cmd.GRAPH_RECOMPUTE, payload)

    # protocol 8.0.0
    def set_tensor_2d(self, t: T, data: bytes, offset: int, size: int, n_copies: int, stride: int) -> None:
        self.send(Cmd.SET_TENSOR_2D, t.pack() + struct.pack("<QQQQ", offset, size, n_copies, stride) + data)

    def get_tensor_2d(self, t: T, offset: int, size: int, n_copies: int, stride: int) -> bytes:
        return self.call(Cmd.GET_TENSOR_2D, t.pack() + struct.pack("<QQQQ", offset, size, n_copies, stride),
                         expect=size * n_copies)

    def comm_init(self, rank: int, world: int, port: int, host: str = "", dev: int = 0) -> int:
        payload = struct.pack("<IIII64s", dev, rank, world, port, host.encode())
        return self.call(Cmd.COMM_INIT, payload, expect=1)[0]


# --- server in a thread -------------------------------------------------------------------------
class ServerThread:
    def __init__(self, npu=None, budget=(3 * GIB, 4 * GIB), weight_format="fp16",
                 cache_dir=None, stall_timeout_s: float = 120.0, weight_reuse: bool = True,
                 group_matmuls: bool = True, protocol: int | None = 7, placement: str = "npu",
                 host_threads: int | None = None, host_repack: bool = False, placement_split: bool = False,
                 retired_budget: int | None = None, pages=None, **config) -> None:
        """``pages``: a ``server.weight_pages.WeightPages`` (None: every buffer anonymous)."""
        budget_fn = npu.memory_budget if npu is not None else (lambda: budget)
        self.state = ServerState(npu=npu, memory=DeviceBudget(budget_fn, pages),
                                 config=ServerConfig(weight_format=weight_format, cache_dir=cache_dir,
                                                     progress=False, stall_timeout_s=stall_timeout_s,
                                                     weight_reuse=weight_reuse, group_matmuls=group_matmuls,
                                                     placement=placement, host_threads=host_threads,
                                                     host_repack=host_repack, placement_split=placement_split,
                                                     retired_budget=retired_budget, **config))
        self.server = RpcServer(self.state, "127.0.0.1", 0, protocol=protocol)
        self.port = self.server.port
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_s": 0.02}, daemon=True)
        self.thread.start()

    def client(self, hello: bool = True) -> RpcClient:
        return RpcClient(self.port, hello=hello, major=self.server.major)

    def alive(self) -> bool:
        """The server answers HELLO and a command on a fresh connection (a command, so that
        ``--protocol auto`` does not take the probe for a client of another major). First waits
        until every earlier client's session has ended: sessions run concurrently, so a test
        that reads the counters after a client left must wait for its close."""
        open_here = sum(1 for c in list(_OPEN_CLIENTS) if c.port in self.server.ports.values())
        self.server.wait_idle(timeout=30.0, leave=open_here)   # raw sockets of a test are not counted
        major = self.server.major
        with self.client(hello=False) as c:
            return c.hello() == wire.PROTO_VERSIONS[major] and c.device_count() == 1

    def stop(self) -> None:
        """Hang up on a client still connected, then free the threadpool once the server thread
        is done (never under a compute it may still be running)."""
        self.server.stop()
        self.thread.join(timeout=60)
        if self.thread.is_alive():
            raise RuntimeError("the server thread did not stop within 60 s; its threadpool is left allocated")
        self.state.close()


@contextmanager
def serve(**kwargs) -> Iterator[ServerThread]:
    """A server on a free loopback port for the ``with`` block; stopped when the block ends,
    however it ends (a ``return`` inside it included)."""
    st = ServerThread(**kwargs)
    try:
        yield st
    finally:
        st.stop()


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``condition()`` holds within ``timeout``, checked as often as it is cheap to: for
    what another thread or process reports without an event to wait on (a counter, a log record)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def wait_for_line(proc: subprocess.Popen[str], pattern: str, lines: list[str], timeout: float = 60.0) -> re.Match:
    """Read a server subprocess's stderr (a text pipe) until a line matches ``pattern`` (lines
    read are kept in ``lines`` for the failure message)."""
    if proc.stderr is None:
        raise ValueError("wait_for_line reads the process's stderr: start it with stderr=PIPE")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(lines)}")
