"""The TCP server llama.cpp talks to with ``--rpc host:port`` (ggml RPC protocol 7.0.0 or 8.0.0,
one major per connection), behaving like the C++ ``ggml-rpc-server`` where the client depends on it
[docs/ggml-rpc.md §3, §4, P6, P7].

Invariants: one client at a time, served to completion; commands strictly in order, replies
only for commands that have one; HELLO first; any bad request (a second HELLO, an unknown
command or handle, a wrong size, a tensor outside its buffer, an unsupported op) gets a
logged reason, then ``shutdown(SHUT_RDWR)`` and close, and the server itself never dies
from a request; buffers and staged weights belong to the connection. SET_TENSOR payloads
are received straight into the destination buffer."""

from __future__ import annotations

import gc
import ipaddress
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_rknpu.engine.contract import MatmulEngine
from ggml_rknpu.libggml import lib as libggml
from ggml_rknpu.libggml.compute import Threads, default_threads
from ggml_rknpu.server.activations import ActivationRounding
from ggml_rknpu.server.buffers import BUFFER_ALIGNMENT, BufferTable, DeviceBuffer, DeviceMemory
from ggml_rknpu.server.placement_policy import Placer, placer_for
from ggml_rknpu.server.plan_cache import DeviceGraphs, graph_digest
from ggml_rknpu.server.planner import GraphPlanner
from ggml_rknpu.server.recovery import NpuRecovery, RecoveryStats
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.proto8 import Proto8
from ggml_rknpu.server.rpc.wire import Cmd, ProtocolError
from ggml_rknpu.server.stats import ServerStats
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor, check_tensor, nbytes
from ggml_rknpu.server.weight_store import RetiredWeights, WeightStats, WeightStore

log = logging.getLogger("ggml_rknpu.rpc")

HOST_ONLY_BUDGET = 4 << 30   # --device host: the RK3588 NPU's 32-bit IOVA window [docs/decisions.md "Interfaces between the layers": 32-bit NPU addresses]
_RECV_CHUNK = 1 << 16


class ClientGone(Exception):
    """EOF from the client: a goodbye at a message boundary, or a truncated message."""

    def __init__(self, truncated: bool) -> None:
        super().__init__("message truncated by EOF" if truncated else "client closed the connection")
        self.truncated = truncated


class Reader:
    """Buffered exact reads from a socket; big payloads go straight into their destination."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_RECV_CHUNK)
        self._view = memoryview(self._buf)
        self._lo = 0
        self._hi = 0
        self.total = 0
        self._idle = select.poll()
        self._idle.register(sock, select.POLLIN)

    def _fill(self, at_boundary: bool) -> None:
        n = self._sock.recv_into(self._view, _RECV_CHUNK)
        if n == 0:
            raise ClientGone(truncated=not at_boundary)
        self._lo, self._hi = 0, n
        self.total += n

    def at_boundary_wait(self) -> None:
        """Block until the next message starts (EOF here is a clean goodbye).

        Between messages a client may stay idle for as long as it likes (llama-server
        holds its connection while waiting for HTTP requests), so this wait has no
        timeout; inside a message the socket timeout applies, so a client that stalls
        mid-message cannot block the (sequential) server forever."""
        if self._lo == self._hi:
            self._idle.poll()          # poll, not select: no FD_SETSIZE limit on the socket's fd
            self._fill(True)

    def read(self, n: int) -> bytes:
        avail = self._hi - self._lo
        if n <= avail:
            out = bytes(self._view[self._lo:self._lo + n])
            self._lo += n
            return out
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def read_into(self, target: memoryview) -> None:
        n = len(target)
        pos = min(n, self._hi - self._lo)
        target[:pos] = self._view[self._lo:self._lo + pos]
        self._lo += pos
        while pos < n:
            if n - pos >= _RECV_CHUNK:               # large remainder: straight into the target
                got = self._sock.recv_into(target[pos:], n - pos)
                if got == 0:
                    raise ClientGone(truncated=True)
                self.total += got
                pos += got
            else:
                self._fill(False)
                take = min(n - pos, self._hi)
                target[pos:pos + take] = self._view[:take]
                self._lo = take
                pos += take


@dataclass
class ServerConfig:
    n_devices: int = 1
    weight_format: str = "fp16"
    cache_dir: Path | None = None
    progress: bool = True
    stats_each_client: bool = False
    stats_json: Path | None = None    # rewritten after every client and at exit
    stall_timeout_s: float = 120.0    # a message (or a reply) that makes no progress this long closes the client
    weight_reuse: bool = True         # keep staged weights of freed buffers for later clients (RetiredWeights)
    threads: int | None = None        # ggml-cpu host threads (None: libggml.compute.default_threads())
    group_matmuls: bool = True        # NPU matmuls reading one activation run as one submit (plan_steps.NpuGroup)
    activations: str = "fp16"         # NPU matmul activations as sent ("fp16") or rounded as ggml-cpu does ("ggml")
    placement: str = "npu"            # weight matmuls: "auto" by cost (rknpu serve's default), "npu", "host"
    host_threads: int | None = None   # A76 threads host matmuls are priced at (None: threads, else the 4 A76s)
    retired_budget: int | None = None  # bytes of retired weights kept (server.host_budget; None: NPU memory only)


@dataclass
class ServerState:
    """What outlives a connection: the engine, the host backend, the device budget, the counters."""

    npu: MatmulEngine | None
    memory: DeviceMemory
    config: ServerConfig
    stats: ServerStats = field(default_factory=ServerStats)
    weight_stats: WeightStats = field(default_factory=WeightStats)
    retired: RetiredWeights | None = None
    host: libggml.Ggml = field(default_factory=libggml.load)   # loaded and ABI-checked at start
    threads: Threads | None = None
    recovery: RecoveryStats = field(default_factory=RecoveryStats)
    faults: Any = None                # sim.faults.FaultInjector under --sim-faults (its counts are reported)
    activations: ActivationRounding | None = None   # shared by the sessions (they run one at a time)
    placer: Placer | None = None      # the placement policy of the weight matmuls (None without an engine)

    def __post_init__(self) -> None:
        if self.config.weight_reuse and self.npu is not None and self.retired is None:
            self.retired = RetiredWeights(self.weight_stats, self.config.retired_budget)
            self.memory.reclaimable = lambda: self.retired.npu_bytes
        if self.activations is None:
            self.activations = ActivationRounding(self.host, self.config.activations)
        if self.threads is None:
            self.threads = Threads(self.host, self.config.threads or default_threads())
        if self.placer is None and self.npu is not None:
            self.placer = placer_for(self.npu, self.config.placement, self.config.weight_format,
                                     self.config.host_threads or self.config.threads)

    def close(self) -> None:
        """Free the retired weights and the host threadpool (server exit)."""
        if self.retired is not None:
            self.retired.clear()
        self.threads.close()

    def stats_dict(self) -> dict:
        """Every counter, machine-readable (``--stats-json``)."""
        out = self.stats.as_dict(self.weight_stats, getattr(self.npu, "counters", None))
        out["recovery"] = self.recovery.as_dict()
        out["activations"] = self.activations.as_dict()
        if self.placer is not None:
            out["placement"] = self.placer.as_dict()
        if self.faults is not None:
            out["faults_injected"] = dict(self.faults.counts, submits=self.faults.submits)
        if hasattr(self.npu, "memory_used"):
            out["npu_memory"] = {"used_bytes": self.npu.memory_used(), "cap_bytes": self.npu.memory_cap,
                                 "peak_bytes": getattr(self.npu, "peak_memory", None)}
        return out

    def render_stats(self) -> str:
        lines = [self.stats.render(self.weight_stats), self.recovery.render()]
        if self.placer is not None and self.placer.records:
            lines.append(self.placer.render())
        if self.faults is not None:
            lines.append(f"faults injected (--sim-faults): {self.faults.counts} in {self.faults.submits} submits")
        w = self.weight_stats
        lines.append(f"weights resident on the NPU: {w.staged} ({w.staged_bytes / 2**20:.1f} MiB ggml data); on the "
                     f"host: {w.host_now} ({w.host_bytes_now / 2**20:.1f} MiB)")
        if hasattr(self.npu, "memory_used"):
            cap = self.npu.memory_cap
            lines.append(f"NPU memory used: {self.npu.memory_used() / 2**20:.1f} MiB"
                         + (f" of a {cap / 2**20:.0f} MiB cap" if cap is not None else ""))
        return "\n".join(lines) + "\n"

    def write_stats_json(self) -> None:
        path = self.config.stats_json
        if path is None:
            return
        try:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.stats_dict(), indent=1))
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write --stats-json %s: %s", path, exc)


def _unsupported_signature(exc: BaseException) -> str | None:
    try:
        from ggml_rknpu.server.ops.vocabulary import UnsupportedOp
    except ImportError:
        return None
    return str(exc) if isinstance(exc, UnsupportedOp) else None


class Session:
    """One client connection: its buffers, weights and graphs, processed strictly in order."""

    def __init__(self, state: ServerState, sock: socket.socket, peer: str, major: int = 7,
                 other_port: int | None = None) -> None:
        """``major``: the protocol this connection is answered with; ``other_port``: where this
        server answers the other major (``--protocol auto``), for the log line of a refusal."""
        self.state = state
        self.sock = sock
        self.peer = peer
        self.major = major
        self.other_port = other_port
        sock.settimeout(state.config.stall_timeout_s)
        self.reader = Reader(sock)
        self.weights = WeightStore(state.npu, state.config.weight_format, state.config.progress, state.weight_stats,
                                   state.retired)
        self.buffers = BufferTable(state.memory, on_free=self._on_free)
        self.graphs = [DeviceGraphs() for _ in range(state.config.n_devices)]
        self.planner = GraphPlanner(self.buffers, self.weights, state.npu, state.stats, state.host, state.threads,
                                    NpuRecovery(state.npu, self.weights, state.recovery),
                                    group=state.config.group_matmuls, activations=state.activations,
                                    placer=state.placer)
        self.hello = False
        self.hung_up = False              # the server is stopping (RpcServer.stop)
        self.clean_end = False            # a goodbye at a message boundary: its staged weights are retired
        self._plans_at_start = state.stats.plans_built
        self.commands_after_hello = 0
        self._pending_hash: tuple[int, int, int] | None = None   # (buffer handle, address, announced hash)
        self._handlers: dict[int, Callable[[int], None]] = {
            Cmd.ALLOC_BUFFER: self._alloc_buffer, Cmd.GET_ALIGNMENT: self._get_alignment,
            Cmd.GET_MAX_SIZE: self._get_max_size, Cmd.BUFFER_GET_BASE: self._buffer_get_base,
            Cmd.FREE_BUFFER: self._free_buffer, Cmd.BUFFER_CLEAR: self._buffer_clear,
            Cmd.SET_TENSOR: self._set_tensor, Cmd.SET_TENSOR_HASH: self._set_tensor_hash,
            Cmd.GET_TENSOR: self._get_tensor, Cmd.COPY_TENSOR: self._copy_tensor,
            Cmd.GRAPH_COMPUTE: self._graph_compute, Cmd.GET_DEVICE_MEMORY: self._get_device_memory,
            Cmd.INIT_TENSOR: self._init_tensor, Cmd.GET_ALLOC_SIZE: self._get_alloc_size,
            Cmd.HELLO: self._hello, Cmd.DEVICE_COUNT: self._device_count,
            Cmd.GRAPH_RECOMPUTE: self._graph_recompute, Cmd.MEMSET_TENSOR: self._memset_tensor,
        }
        self.proto8 = Proto8(self) if major == 8 else None
        if self.proto8 is not None:
            self._handlers.update(self.proto8.handlers())

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        stats = self.state.stats
        stats.connections += 1
        try:
            while True:
                self.reader.at_boundary_wait()
                cmd, size = wire.REQUEST_HEADER.unpack(self.reader.read(wire.REQUEST_HEADER.size))
                wire.expected_payload(cmd, size, self.major)
                if not self.hello and cmd != Cmd.HELLO:
                    raise ProtocolError(f"expected HELLO first, got {Cmd(cmd).name}")
                self.commands_after_hello += self.hello
                stats.commands[cmd] += 1
                self._handlers[cmd](size)
        except (ClientGone, ConnectionError) as exc:
            self.clean_end = self.hung_up or (isinstance(exc, ClientGone) and not exc.truncated)
            if self.hung_up:
                log.info("ended the connection of %s: the server is stopping", self.peer)
            elif isinstance(exc, ConnectionError):
                log.info("%s went away: %s", self.peer, exc)
            elif exc.truncated:
                stats.rejected += 1
                log.warning("closing %s: %s", self.peer, exc)
            elif self.hello and not self.commands_after_hello:   # every llama.cpp client sends a command next
                log.warning("%s: %s", self.peer, wire.hello_then_gone(self.major, self.other_port))
            else:
                log.debug("%s: %s", self.peer, exc)
        except ProtocolError as exc:
            stats.rejected += 1
            log.warning("closing %s: %s", self.peer, exc)
        except TimeoutError as exc:
            if exc.errno is None:      # our socket timeout, not the kernel's keepalive verdict
                stats.rejected += 1
                log.warning("closing %s: no progress for %.0f s in the middle of a message",
                            self.peer, self.state.config.stall_timeout_s)
            else:
                log.warning("%s vanished (TCP keepalive: %s)", self.peer, exc)
        except Exception as exc:  # op failures, data errors, engine errors: close, keep serving
            signature = _unsupported_signature(exc)
            if signature is not None:
                stats.unsupported += 1
                log.error("closing %s: %s (the client will abort; no rule of the validator admits it)",
                          self.peer, signature)
            else:
                stats.rejected += 1
                log.exception("closing %s after an error while serving it: %s", self.peer, exc)
        finally:
            stats.bytes_in += self.reader.total
            self.close()

    def hang_up(self) -> None:
        """Shut the connection down: a wait for the client ends at once (EOF), and the session
        then ends through its own path, between commands or inside one."""
        self.hung_up = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # P6: makes the client see the close at once
        except OSError:
            pass
        self.sock.close()
        for g in self.graphs:
            g.clear()
        if self.proto8 is not None:
            self.proto8.close()
        self.weights.retire_on_free = self.clean_end
        try:
            self.buffers.close()
        finally:
            self.weights.close()
            # A session that built plans leaves reference cycles holding views of its buffers
            # (22 unreachable objects per small client with GraphPlan), and the handler table
            # holds bound methods of the session: without a
            # collection here a client's compute buffers would outlive it until the next full
            # cyclic collection (RSS grew ~80 KiB per small client in tests/server/test_rpc_churn.py).
            # Only sessions that built plans pay for it (not llama.cpp's memory probes).
            self._handlers.clear()
            if self.state.stats.plans_built != self._plans_at_start:
                gc.collect()

    def _send(self, payload: bytes) -> None:
        self.sock.sendall(wire.pack_response(payload))
        self.state.stats.bytes_out += len(payload) + 8

    # --- helpers --------------------------------------------------------------------------
    def _dev(self, dev: int, what: str) -> int:
        if dev >= self.state.config.n_devices:
            raise ProtocolError(f"{what}: device {dev} does not exist ({self.state.config.n_devices} device(s))")
        return dev

    def _tensor(self, payload: bytes, offset: int, what: str) -> CheckedTensor:
        t = RpcTensor.unpack_from(payload, offset)
        checked = check_tensor(t, self.buffers, what)
        if checked.buffer is None:
            raise ProtocolError(f"{what} '{t.name}': tensor has no buffer on this server")
        return checked

    def _written(self, buf: DeviceBuffer, start: int, end: int) -> None:
        if end > start:
            self.weights.invalidate(buf, start, end)

    def _on_free(self, buf: DeviceBuffer) -> None:
        self.weights.drop_buffer(buf)
        for g in self.graphs:          # like the C++ server: any FREE_BUFFER drops stored graphs
            g.clear()
        if self.proto8 is not None:
            self.proto8.on_free()

    # --- commands -------------------------------------------------------------------------
    def _hello(self, size: int) -> None:
        self.reader.read(size)
        if self.hello:
            raise ProtocolError("second HELLO in one connection")
        self.hello = True
        major, minor, patch = wire.PROTO_VERSIONS[self.major]
        self._send(wire.HELLO_RSP.pack(major, minor, patch, 0, bytes(24)))   # zero caps: TCP only

    def _device_count(self, size: int) -> None:
        self._send(wire.U32.pack(self.state.config.n_devices))

    def _alloc_buffer(self, size: int) -> None:
        dev, nbytes_ = wire.ALLOC_BUFFER_REQ.unpack(self.reader.read(size))
        self._dev(dev, "ALLOC_BUFFER")
        buf = self.buffers.alloc(nbytes_)
        self._send(wire.ALLOC_BUFFER_RSP.pack(buf.handle, buf.size) if buf else wire.ALLOC_BUFFER_RSP.pack(0, 0))

    def _get_alignment(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.reader.read(size))
        self._dev(dev, "GET_ALIGNMENT")
        self._send(wire.U64.pack(BUFFER_ALIGNMENT))

    def _get_max_size(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.reader.read(size))
        self._dev(dev, "GET_MAX_SIZE")
        self._send(wire.U64.pack(self.state.memory.max_buffer()))

    def _get_device_memory(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.reader.read(size))
        self._dev(dev, "GET_DEVICE_MEMORY")
        self._send(wire.DEVICE_MEMORY_RSP.pack(*self.state.memory.report()))

    def _buffer_get_base(self, size: int) -> None:
        (handle,) = wire.U64.unpack(self.reader.read(size))
        self._send(wire.U64.pack(self.buffers.get(handle, "BUFFER_GET_BASE").base))

    def _free_buffer(self, size: int) -> None:
        (handle,) = wire.U64.unpack(self.reader.read(size))
        self.buffers.free(handle)

    def _buffer_clear(self, size: int) -> None:
        handle, value = wire.BUFFER_CLEAR_REQ.unpack(self.reader.read(size))
        buf = self.buffers.get(handle, "BUFFER_CLEAR")
        buf.array.fill(value)
        self._written(buf, 0, buf.size)

    def _set_tensor(self, size: int) -> None:
        header = self.reader.read(wire.SET_TENSOR_HEADER_SIZE)
        t = self._tensor(header, 0, "SET_TENSOR")
        cache_flag, offset = wire.SET_TENSOR_TAIL.unpack_from(header, wire.RPC_TENSOR_SIZE)
        n = size - wire.SET_TENSOR_HEADER_SIZE
        start, end = t.buffer.span(t.rpc.data + offset, n, f"SET_TENSOR '{t.rpc.name}' at +{offset}")
        self.reader.read_into(memoryview(t.buffer.array)[start:end])
        self._written(t.buffer, start, end)
        if cache_flag and self.state.config.cache_dir is not None:
            self._cache_store(t.buffer, t.rpc.data + offset, start, end)

    def _set_tensor_hash(self, size: int) -> None:
        payload = self.reader.read(size)
        t = self._tensor(payload, 0, "SET_TENSOR_HASH")
        offset, digest = wire.TENSOR_OFFSET_U64.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        self._send(wire.U8.pack(self._cache_load(t, offset, digest)))

    def _get_tensor(self, size: int) -> None:
        payload = self.reader.read(size)
        t = self._tensor(payload, 0, "GET_TENSOR")
        offset, n = wire.TENSOR_OFFSET_U64.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        start, end = t.buffer.span(t.rpc.data + offset, n, f"GET_TENSOR '{t.rpc.name}' at +{offset}")
        data = memoryview(t.buffer.array)[start:end]
        if n <= _RECV_CHUNK:                      # one segment for the per-token logits read
            self.sock.sendall(wire.RESPONSE_HEADER.pack(n) + data.tobytes())
        else:
            self.sock.sendall(wire.RESPONSE_HEADER.pack(n))
            self.sock.sendall(data)
        self.state.stats.bytes_out += n + 8

    def _memset_tensor(self, size: int) -> None:
        payload = self.reader.read(size)
        t = self._tensor(payload, 0, "MEMSET_TENSOR")
        offset, n, value = wire.MEMSET_TAIL.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        start, end = t.buffer.span(t.rpc.data + offset, n, f"MEMSET_TENSOR '{t.rpc.name}' at +{offset}")
        t.buffer.array[start:end] = value
        self._written(t.buffer, start, end)

    def _copy_tensor(self, size: int) -> None:
        payload = self.reader.read(size)
        src = self._tensor(payload, 0, "COPY_TENSOR src")
        dst = self._tensor(payload, wire.RPC_TENSOR_SIZE, "COPY_TENSOR dst")
        n = src.end - src.start
        start, end = dst.buffer.span(dst.rpc.data, n, f"COPY_TENSOR of {n} bytes into '{dst.rpc.name}'")
        dst.buffer.array[start:end] = src.buffer.array[src.start:src.end]   # numpy handles overlap
        self._written(dst.buffer, start, end)
        self._send(wire.U8.pack(1))

    def _init_tensor(self, size: int) -> None:
        payload = self.reader.read(size)
        self._tensor(payload, 0, "INIT_TENSOR")   # validated; host buffers need no per-tensor init

    def _get_alloc_size(self, size: int) -> None:
        payload = self.reader.read(size)
        (dev,) = wire.DEV_REQ.unpack_from(payload, 0)
        self._dev(dev, "GET_ALLOC_SIZE")
        t = RpcTensor.unpack_from(payload, wire.DEV_REQ.size)
        self._send(wire.U64.pack(nbytes(t, "GET_ALLOC_SIZE")))   # plain host layout: ggml_nbytes

    def _graph_compute(self, size: int) -> None:
        payload = self.reader.read(size)
        (dev,) = wire.DEV_REQ.unpack_from(payload, 0)
        self.compute_graph(self._dev(dev, "GRAPH_COMPUTE"), payload, graph_digest(payload))

    def compute_graph(self, dev: int, payload: bytes, digest: bytes, replay: bool = False) -> None:
        """Run a graph in 7.0.0 layout: its plan from the cache, or built (and validated) now.
        ``replay``: a GRAPH_RECOMPUTE (counted as such, not as a plan cache hit)."""
        graphs = self.graphs[dev]
        plan = graphs.lookup(digest)
        if plan is None:
            plan = self.planner.build(payload, digest)
        elif not replay:
            self.state.stats.plan_cache_hits += 1
        graphs.remember(plan)
        plan.execute(self.state.stats)

    def _graph_recompute(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.reader.read(size))
        plan = self.graphs[self._dev(dev, "GRAPH_RECOMPUTE")].last
        if plan is None:
            raise ProtocolError(f"GRAPH_RECOMPUTE on device {dev} without a stored graph")
        self.state.stats.recomputes += 1
        plan.execute(self.state.stats)

    # --- the ggml-rpc-server -c style cache ---------------------------------------------------
    def _cache_path(self, digest: int) -> Path:
        return self.state.config.cache_dir / f"{digest:016x}"

    def _cache_load(self, t: CheckedTensor, offset: int, digest: int) -> int:
        """1 if the bytes with this FNV-1a-64 hash are in the cache (and now in the tensor)."""
        cache = self.state.config.cache_dir
        self._pending_hash = None
        if cache is None:
            return 0
        path = self._cache_path(digest)
        if not path.is_file():
            self._pending_hash = (t.buffer.handle, t.rpc.data + offset, digest)
            return 0
        n = path.stat().st_size
        start, end = t.buffer.span(t.rpc.data + offset, n, f"SET_TENSOR_HASH '{t.rpc.name}' at +{offset}")
        with open(path, "rb") as f:
            if f.readinto(memoryview(t.buffer.array)[start:end]) != n:
                raise ProtocolError(f"cache file {path} changed while reading")
        self._written(t.buffer, start, end)
        return 1

    def _cache_store(self, buf: DeviceBuffer, addr: int, start: int, end: int) -> None:
        """Store bytes the client marked cacheable under the hash it announced for them.

        Deviation from the C++ server (documented): the name is the FNV-1a-64 the client
        sent in the SET_TENSOR_HASH that immediately preceded this write, not a hash we
        recompute; a pure-Python FNV over a model's tensors would cost seconds per 10 MiB.
        """
        pending, self._pending_hash = self._pending_hash, None
        if pending is None or pending[:2] != (buf.handle, addr):
            return
        path = self._cache_path(pending[2])
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(memoryview(buf.array)[start:end])
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write the tensor cache %s: %s", path, exc)


def _keepalive(sock: socket.socket) -> None:
    """Detect a client that vanished without closing (a board across a dropped network link)
    in about 90 s, instead of holding the one-client-at-a-time server for hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):                # Linux names; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RpcServer:
    """Accepts clients one after another on (host, port); ``serve_forever`` until ``stop``.

    ``protocol``: the RPC major every connection is answered with, or None (``--protocol auto``):
    7.0.0 on ``port`` and 8.0.0 on ``port + 1`` (any free port for both when ``port`` is 0), one
    listener per major because a client's HELLO carries no version [docs/server.md: Choosing
    the protocol]. Clients of both ports are still served one at a time."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 50052,
                 protocol: int | None = 7) -> None:
        if protocol is not None and protocol not in wire.PROTO_VERSIONS:
            raise ValueError(f"RPC protocol {protocol} is not served (only {sorted(wire.PROTO_VERSIONS)})")
        self.state = state
        self.host = host
        self.auto = protocol is None
        if not is_loopback(host):
            log.warning("!!! rknpu serve is bound to %s: the ggml RPC protocol has NO authentication; anyone who "
                        "can reach this port can read and write its memory. Use 127.0.0.1 unless this network "
                        "is trusted (P13). !!!", host)
        majors = sorted(wire.PROTO_VERSIONS) if self.auto else [protocol]
        self.listeners: dict[socket.socket, int] = {}
        try:
            for i, major in enumerate(majors):
                self.listeners[self._listen(host, port + i if port else 0)] = major
        except OSError:
            for listener in self.listeners:
                listener.close()
            raise
        self.ports = {major: listener.getsockname()[1] for listener, major in self.listeners.items()}
        self.major = majors[0]
        self.port = self.ports[self.major]
        self._stop = threading.Event()
        self._session: Session | None = None

    @staticmethod
    def _listen(host: str, port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        return listener

    def serve_forever(self, poll_s: float = 0.2) -> None:
        runs_reported = 0
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select(list(self.listeners), [], [], poll_s)
                if not ready:
                    continue
                major = self.listeners[ready[0]]
                try:
                    sock, addr = ready[0].accept()
                except OSError:
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _keepalive(sock)
                peer = f"{addr[0]}:{addr[1]}"
                log.debug("client %s connected (protocol %d)", peer, major)
                t0 = time.perf_counter()
                other_port = next((p for m, p in self.ports.items() if m != major), None)
                try:
                    self._session = Session(self.state, sock, peer, major, other_port)
                    if self._stop.is_set():     # stopped between accept and here
                        self._session.hang_up()
                    self._session.run()
                except Exception:          # a failure while tearing a session down must not end the server
                    log.exception("error while closing the session of %s", peer)
                    sock.close()
                finally:
                    self._session = None
                log.debug("client %s done after %.2f s", peer, time.perf_counter() - t0)
                if self.state.stats.graph_runs != runs_reported:   # not after every memory probe
                    runs_reported = self.state.stats.graph_runs
                    if self.state.config.stats_each_client:
                        log.info("\n%s", self.state.render_stats())
                    self.state.write_stats_json()
        finally:
            for listener in self.listeners:
                listener.close()

    def stop(self) -> None:
        """Stop now (SIGTERM / SIGINT handlers, or any thread): hang up on the current client,
        whose session then frees everything through its own path, and return from ``serve_forever``.

        A handler must not raise instead: CPython runs it between any two bytecodes of the main
        thread, so its exception would unwind the data plane anywhere, e.g. between a free and
        the reset of the freed handle, and the unwinding would free it again (docs/server.md
        "Stopping")."""
        self._stop.set()
        session = self._session
        if session is not None:
            session.hang_up()
