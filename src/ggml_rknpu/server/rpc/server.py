"""The TCP server llama.cpp talks to with ``--rpc host:port`` (ggml RPC protocol 7.0.0 or 8.0.0,
one major per connection), behaving like the C++ ``ggml-rpc-server`` where the client depends on it
[docs/ggml-rpc.md §3, §4, P6, P7].

Invariants: every connection is served at once by its own thread, which blocks only in its
own socket I/O or waiting for its turn (``server.turns``: FIFO, never held across I/O), so a
stalled or hostile client costs the others nothing; in a connection, commands strictly in
order, replies only for commands that have one; HELLO first; a bad request (a second HELLO,
an unknown command or handle, a wrong size, a tensor outside its buffer, an unsupported op)
gets a logged reason, ``shutdown(SHUT_RDWR)`` and close, never the server's death; buffers
belong to the connection, staged weights are shared by content (``live_weights``); SET_TENSOR
payloads go straight into their buffer. Why threads: docs/server.md "Concurrent sessions"."""

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ggml_rknpu.engine.contract import MatmulEngine
from ggml_rknpu.libggml import lib as libggml
from ggml_rknpu.libggml.compute import Threads, default_threads
from ggml_rknpu.server.activations import ActivationRounding
from ggml_rknpu.server.buffers import BUFFER_ALIGNMENT, BufferTable, DeviceBuffer, DeviceMemory
from ggml_rknpu.server.host_budget import TRIM_AFTER_FREED_BYTES, return_free_heap
from ggml_rknpu.server.live_weights import LiveWeights
from ggml_rknpu.server.placement_policy import Placer, placer_for
from ggml_rknpu.server.plan_cache import DeviceGraphs, graph_digest
from ggml_rknpu.server.planner import GraphPlanner
from ggml_rknpu.server.recovery import NpuRecovery, RecoveryStats
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.deadlines import (
    MIN_RATE_KIB_S,
    RECV_CHUNK,
    ClientGone,
    Deadlines,
    IdleTimeout,
    Reader,
    Stalled,
    TooSlow,
)
from ggml_rknpu.server.rpc.proto8 import Proto8
from ggml_rknpu.server.rpc.wire import Cmd, ProtocolError
from ggml_rknpu.server.stats import ServerStats
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor, check_tensor, nbytes
from ggml_rknpu.server.turns import Turns
from ggml_rknpu.server.weight_store import RetiredWeights, WeightStats, WeightStore

log = logging.getLogger("ggml_rknpu.rpc")

HOST_ONLY_BUDGET = 4 << 30   # --device host: the RK3588 NPU's 32-bit IOVA window [docs/decisions.md "Interfaces between the layers": 32-bit NPU addresses]
MAX_CLIENTS = 256            # connections served at once; one more is refused at accept (--max-clients)
LISTEN_BACKLOG = 128         # connections the kernel queues while the accept loop catches up


@dataclass
class ServerConfig:
    n_devices: int = 1
    weight_format: str = "fp16"
    cache_dir: Path | None = None
    progress: bool = True
    stats_each_client: bool = False
    stats_json: Path | None = None    # rewritten after every client and at exit
    stall_timeout_s: float = 120.0    # a message (or a reply) that makes no progress this long closes the client
    min_rate_kib_s: float = MIN_RATE_KIB_S   # ... as does one not complete in stall_timeout_s + bytes / this rate
    weight_reuse: bool = True         # keep staged weights of freed buffers for later clients (RetiredWeights)
    threads: int | None = None        # ggml-cpu host threads (None: libggml.compute.default_threads())
    group_matmuls: bool = True        # NPU matmuls reading one activation run as one submit (plan_steps.NpuGroup)
    activations: str = "fp16"         # NPU matmul activations as sent ("fp16") or rounded as ggml-cpu does ("ggml")
    placement: str = "npu"            # weight matmuls: "auto" by cost (rknpu serve's default), "npu", "host"
    host_threads: int | None = None   # A76 threads host matmuls are priced at (None: threads, else the 4 A76s)
    host_repack: bool = False         # host matmuls read a repacked copy where ggml-cpu repacks (rknpu serve: on)
    placement_split: bool = False     # auto may split a matmul's rows between the NPU and the host (opt-in)
    npu_attention: str = "auto"       # attention's matmuls on the NPU: "auto" by cost, "on", "off" (server/attention_plan.py)
    idle_timeout_s: float | None = None   # close a client idle this long between messages (None: never)
    max_clients: int = MAX_CLIENTS    # connections served at once; more are refused at accept
    session_memory: int | None = None  # buffer bytes one connection may hold (None: the device budget)
    retired_budget: int | None = None  # bytes of retired weights kept (server.host_budget; None: NPU memory only)


@dataclass
class SessionCounts:
    """Server-wide counts of the connection layer (``--stats-json`` "sessions")."""

    now: int = 0                      # connections being served
    peak: int = 0                     # most at once
    refused_at_accept: int = 0        # over --max-clients
    stalled: int = 0                  # dropped: no progress within a message (or a reply) for --stall-timeout
    too_slow: int = 0                 # dropped: a message (or a reply) past its deadline (--min-rate)
    idle_closed: int = 0              # dropped: idle between messages for --idle-timeout
    over_session_memory: int = 0      # ALLOC_BUFFERs refused by --session-memory


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
    activations: ActivationRounding | None = None   # shared by the sessions (used under a turn)
    placer: Placer | None = None      # the placement policy of the weight matmuls (None without an engine)
    turns: Turns = field(default_factory=Turns)     # the device's FIFO turns: all shared work below
    live: LiveWeights = field(default_factory=LiveWeights)   # staged copies in use, shared by content
    sessions: SessionCounts = field(default_factory=SessionCounts)
    counting: threading.Lock = field(default_factory=threading.Lock)   # the I/O counters, outside a turn
    _stats_file: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.config.weight_reuse and self.npu is not None and self.retired is None:
            retired = self.retired = RetiredWeights(self.weight_stats, self.config.retired_budget)
            self.memory.reclaimable = lambda: retired.npu_bytes
        if self.activations is None:
            self.activations = ActivationRounding(self.host, self.config.activations)
        if self.threads is None:
            self.threads = Threads(self.host, self.config.threads or default_threads())
        if self.placer is None and self.npu is not None:
            self.placer = placer_for(self.npu, self.config.placement, self.config.weight_format,
                                     self.config.host_threads or self.config.threads, self.config.host_repack,
                                     self.config.placement_split)

    def close(self) -> None:
        """Free the retired weights and the host threadpool (server exit)."""
        if self.retired is not None:
            self.retired.clear()
        if self.threads is not None:
            self.threads.close()

    def stats_dict(self) -> dict:
        """Every counter, machine-readable (``--stats-json``); read under a turn, since the
        sessions' computes update them."""
        with self.turns:
            return self._stats_dict()

    def _stats_dict(self) -> dict:
        out = self.stats.as_dict(self.weight_stats, getattr(self.npu, "counters", None))
        out["recovery"] = self.recovery.as_dict()
        out["sessions"] = asdict(self.sessions)
        out["turns"] = self.turns.as_dict()
        out["shared_weights"] = self.live.as_dict()
        if self.activations is not None:
            out["activations"] = self.activations.as_dict()
        if self.placer is not None:
            out["placement"] = self.placer.as_dict()
        if self.faults is not None:
            out["faults_injected"] = dict(self.faults.counts, submits=self.faults.submits)
        npu: Any = self.npu             # memory_used / memory_cap: the engines that cap NPU memory
        if hasattr(npu, "memory_used"):
            out["npu_memory"] = {"used_bytes": npu.memory_used(), "cap_bytes": npu.memory_cap,
                                 "peak_bytes": getattr(npu, "peak_memory", None)}
        return out

    def render_stats(self) -> str:
        with self.turns:
            return self._render_stats()

    def _render_stats(self) -> str:
        lines = [self.stats.render(self.weight_stats), self.recovery.render()]
        c = self.sessions
        lines.append(f"connections: {c.now} now, {c.peak} at most at once, {c.refused_at_accept} refused at accept, "
                     f"{c.stalled} stalled, {c.too_slow} too slow, {c.idle_closed} idle; {self.live.copies} staged "
                     f"copies shared ({self.live.shared} stagings from another session's); {self.turns.waited} of "
                     f"{self.turns.granted} turns waited {self.turns.wait_seconds:.2f} s")
        if self.placer is not None and self.placer.records:
            lines.append(self.placer.render())
        if self.faults is not None:
            lines.append(f"faults injected (--sim-faults): {self.faults.counts} in {self.faults.submits} submits")
        w = self.weight_stats
        lines.append(f"weights resident on the NPU: {w.staged} ({w.staged_bytes / 2**20:.1f} MiB ggml data); on the "
                     f"host: {w.host_now} ({w.host_bytes_now / 2**20:.1f} MiB)")
        npu: Any = self.npu
        if hasattr(npu, "memory_used"):
            cap = npu.memory_cap
            lines.append(f"NPU memory used: {npu.memory_used() / 2**20:.1f} MiB"
                         + (f" of a {cap / 2**20:.0f} MiB cap" if cap is not None else ""))
        return "\n".join(lines) + "\n"

    def write_stats_json(self) -> None:
        path = self.config.stats_json
        if path is None:
            return
        try:
            with self._stats_file:         # sessions end (and write) concurrently
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
        self.deadlines = Deadlines(sock, state.config.stall_timeout_s, state.config.min_rate_kib_s)
        self.reader = Reader(self.deadlines)
        self.weights = WeightStore(state.npu, state.config.weight_format, state.config.progress, state.weight_stats,
                                   state.retired, state.live)
        self.buffers = BufferTable(state.memory, on_free=self._on_free)
        self.graphs = [DeviceGraphs() for _ in range(state.config.n_devices)]
        assert state.threads is not None, "ServerState.__post_init__ makes the threadpool"
        self.planner = GraphPlanner(self.buffers, self.weights, state.npu, state.stats, state.host, state.threads,
                                    NpuRecovery(state.npu, self.weights, state.recovery),
                                    group=state.config.group_matmuls, activations=state.activations,
                                    placer=state.placer, host_repack=state.config.host_repack,
                                    npu_attention=state.config.npu_attention)
        self.hello = False
        self.hung_up = False              # the server is stopping (RpcServer.stop)
        self.allocated = 0                # bytes of this connection's buffers (--session-memory)
        self.peak_allocated = 0
        self.freed_untrimmed = 0          # bytes of buffers freed since the heap was last trimmed
        self._built_plans = False         # this connection planned a graph (its close collects cycles)
        self.clean_end = False            # a goodbye at a message boundary: its staged weights are retired
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
        state = self.state
        stats = state.stats
        with state.counting:
            stats.connections += 1
        try:
            while True:
                header = self.reader.next_header(wire.REQUEST_HEADER.size, state.config.idle_timeout_s)
                cmd, size = wire.REQUEST_HEADER.unpack(header)
                wire.expected_payload(cmd, size, self.major)
                self.deadlines.what = f"a {Cmd(cmd).name} message of {len(header) + size} bytes"
                if not self.hello and cmd != Cmd.HELLO:
                    raise ProtocolError(f"expected HELLO first, got {Cmd(cmd).name}")
                self.commands_after_hello += self.hello
                with state.counting:
                    stats.commands[cmd] += 1
                self._handlers[cmd](size)
        except (ClientGone, ConnectionError) as exc:
            self.clean_end = self.hung_up or (isinstance(exc, ClientGone) and not exc.truncated)
            if self.hung_up:
                log.info("ended the connection of %s: the server is stopping", self.peer)
            elif isinstance(exc, ConnectionError):
                log.info("%s went away: %s", self.peer, exc)
            elif exc.truncated:
                self._count_rejected()
                log.warning("closing %s: %s", self.peer, exc)
            elif self.hello and not self.commands_after_hello:   # every llama.cpp client sends a command next
                log.warning("%s: %s", self.peer, wire.hello_then_gone(self.major, self.other_port))
            else:
                log.debug("%s: %s", self.peer, exc)
        except ProtocolError as exc:
            self._count_rejected()
            log.warning("closing %s: %s", self.peer, exc)
        except IdleTimeout as exc:
            with state.counting:
                state.sessions.idle_closed += 1
            log.info("closing %s: %s between messages (--idle-timeout)", self.peer, exc)
        except Stalled as exc:
            self._count_rejected()
            with state.counting:
                state.sessions.stalled += 1
            log.warning("closing %s: %s", self.peer, exc)
        except TooSlow as exc:
            self._count_rejected()
            with state.counting:
                state.sessions.too_slow += 1
            log.warning("closing %s: %s", self.peer, exc)
        except TimeoutError as exc:    # the kernel's verdict: our own socket timeouts are the two above
            log.warning("%s vanished (TCP keepalive: %s)", self.peer, exc)
        except Exception as exc:  # op failures, data errors, engine errors: close, keep serving
            signature = _unsupported_signature(exc)
            if signature is not None:
                with state.counting:
                    stats.unsupported += 1
                log.error("closing %s: %s (the client will abort; no rule of the validator admits it)",
                          self.peer, signature)
            else:
                self._count_rejected()
                log.exception("closing %s after an error while serving it: %s", self.peer, exc)
        finally:
            with state.counting:
                stats.bytes_in += self.reader.total
            self.close()

    def _count_rejected(self) -> None:
        with self.state.counting:
            self.state.stats.rejected += 1

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
        with self.state.turns:
            self._free_all()
        if self.freed_untrimmed:
            self._trim_heap()
        if self.peak_allocated:
            log.debug("%s held at most %.1f MiB of buffers", self.peer, self.peak_allocated / 2**20)

    def _trim_heap(self) -> None:
        """What the freed buffers' weights and temporaries left in the C heap goes back to the
        system (docs/memory.md "The C library's heap")."""
        self.freed_untrimmed = 0
        return_free_heap()
        with self.state.counting:
            self.state.stats.heap_trims += 1

    def _free_all(self) -> None:
        """Free the connection's plans, buffers and weights (under a turn: they reach shared state)."""
        for g in self.graphs:
            g.clear()
        if self.proto8 is not None:
            self.proto8.close()
        self.weights.retire_on_free = self.clean_end
        try:
            self.buffers.close()
        finally:
            self.weights.close()
            self.planner.host_copies.close()
            # A session that built plans leaves reference cycles holding views of its buffers
            # (22 unreachable objects per small client with GraphPlan), and the handler table
            # holds bound methods of the session: without a
            # collection here a client's compute buffers would outlive it until the next full
            # cyclic collection (RSS grew ~80 KiB per small client in tests/server/test_rpc_churn.py).
            # Only sessions that built plans pay for it (not llama.cpp's memory probes).
            self._handlers.clear()
            if self._built_plans:      # inside the turn: what the collection frees may reach the engine
                gc.collect()

    def _send(self, payload: bytes) -> None:
        self.deadlines.send(wire.pack_response(payload))
        self._count_out(len(payload) + 8)

    def _count_out(self, n: int) -> None:
        with self.state.counting:
            self.state.stats.bytes_out += n

    # --- helpers --------------------------------------------------------------------------
    def _dev(self, dev: int, what: str) -> int:
        if dev >= self.state.config.n_devices:
            raise ProtocolError(f"{what}: device {dev} does not exist ({self.state.config.n_devices} device(s))")
        return dev

    def _tensor(self, payload: bytes, offset: int, what: str) -> CheckedTensor:
        return self._target(payload, offset, what)[0]

    def _target(self, payload: bytes, offset: int, what: str) -> tuple[CheckedTensor, DeviceBuffer]:
        """The checked tensor at ``offset`` and the buffer it lies in (ProtocolError: none here)."""
        t = RpcTensor.unpack_from(payload, offset)
        checked = check_tensor(t, self.buffers, what)
        if checked.buffer is None:
            raise ProtocolError(f"{what} '{t.name}': tensor has no buffer on this server")
        return checked, checked.buffer

    def _written(self, buf: DeviceBuffer, start: int, end: int) -> None:
        if end > start:
            with self.state.turns:
                self.weights.invalidate(buf, start, end)
                self.planner.host_copies.invalidate(buf, start, end)

    def _on_free(self, buf: DeviceBuffer) -> None:
        self.allocated -= buf.size
        self.freed_untrimmed += buf.size
        self.weights.drop_buffer(buf)
        for g in self.graphs:          # like the C++ server: any FREE_BUFFER drops stored graphs
            g.clear()
        self.planner.host_copies.drop_buffer(buf)
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
        buf = self._alloc(nbytes_)
        self._send(wire.ALLOC_BUFFER_RSP.pack(buf.handle, buf.size) if buf else wire.ALLOC_BUFFER_RSP.pack(0, 0))

    def _alloc(self, n: int) -> DeviceBuffer | None:
        """A buffer within this connection's limit and the device budget, or None (the client
        sees an allocation failure, as from the C++ server), with the reason logged."""
        limit = self.state.config.session_memory
        if limit is not None and self.allocated + n > limit:
            with self.state.counting:
                self.state.sessions.over_session_memory += 1
            log.warning("%s: ALLOC_BUFFER of %d bytes refused: this connection already holds %d bytes of "
                        "buffers, and --session-memory allows %d", self.peer, n, self.allocated, limit)
            return None
        with self.state.turns:
            buf = self.buffers.alloc(n)
        if buf is not None:
            self.allocated += buf.size
            self.peak_allocated = max(self.peak_allocated, self.allocated)
        return buf

    def _get_alignment(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.reader.read(size))
        self._dev(dev, "GET_ALIGNMENT")
        self._send(wire.U64.pack(BUFFER_ALIGNMENT))

    def _get_max_size(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.reader.read(size))
        self._dev(dev, "GET_MAX_SIZE")
        with self.state.turns:
            max_buffer = self.state.memory.max_buffer()
        self._send(wire.U64.pack(max_buffer))

    def _get_device_memory(self, size: int) -> None:
        (dev,) = wire.DEV_REQ.unpack(self.reader.read(size))
        self._dev(dev, "GET_DEVICE_MEMORY")
        with self.state.turns:
            free, total = self.state.memory.report()
        limit = self.state.config.session_memory
        if limit is not None:          # what this connection may still allocate, so -fit plans within it
            free = min(free, max(0, limit - self.allocated))
        self._send(wire.DEVICE_MEMORY_RSP.pack(free, total))

    def _buffer_get_base(self, size: int) -> None:
        (handle,) = wire.U64.unpack(self.reader.read(size))
        self._send(wire.U64.pack(self.buffers.get(handle, "BUFFER_GET_BASE").base))

    def _free_buffer(self, size: int) -> None:
        (handle,) = wire.U64.unpack(self.reader.read(size))
        with self.state.turns:
            self.buffers.free(handle)
        if self.freed_untrimmed >= TRIM_AFTER_FREED_BYTES:
            self._trim_heap()

    def _buffer_clear(self, size: int) -> None:
        handle, value = wire.BUFFER_CLEAR_REQ.unpack(self.reader.read(size))
        buf = self.buffers.get(handle, "BUFFER_CLEAR")
        buf.array.fill(value)
        self._written(buf, 0, buf.size)

    def _set_tensor(self, size: int) -> None:
        header = self.reader.read(wire.SET_TENSOR_HEADER_SIZE)
        t, buf = self._target(header, 0, "SET_TENSOR")
        cache_flag, offset = wire.SET_TENSOR_TAIL.unpack_from(header, wire.RPC_TENSOR_SIZE)
        n = size - wire.SET_TENSOR_HEADER_SIZE
        start, end = buf.span(t.rpc.data + offset, n, f"SET_TENSOR '{t.rpc.name}' at +{offset}")
        self.reader.read_into(buf.array.data[start:end])
        self._written(buf, start, end)
        if cache_flag and self.state.config.cache_dir is not None:
            self._cache_store(self.state.config.cache_dir, buf, t.rpc.data + offset, start, end)

    def _set_tensor_hash(self, size: int) -> None:
        payload = self.reader.read(size)
        t, buf = self._target(payload, 0, "SET_TENSOR_HASH")
        offset, digest = wire.TENSOR_OFFSET_U64.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        self._send(wire.U8.pack(self._cache_load(t, buf, offset, digest)))

    def _get_tensor(self, size: int) -> None:
        payload = self.reader.read(size)
        t, buf = self._target(payload, 0, "GET_TENSOR")
        offset, n = wire.TENSOR_OFFSET_U64.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        start, end = buf.span(t.rpc.data + offset, n, f"GET_TENSOR '{t.rpc.name}' at +{offset}")
        data = buf.array.data[start:end]
        if n <= RECV_CHUNK:                      # one segment for the per-token logits read
            self.deadlines.send(wire.RESPONSE_HEADER.pack(n) + data.tobytes())
        else:
            self.deadlines.send(wire.RESPONSE_HEADER.pack(n), data)
        self._count_out(n + 8)

    def _memset_tensor(self, size: int) -> None:
        payload = self.reader.read(size)
        t, buf = self._target(payload, 0, "MEMSET_TENSOR")
        offset, n, value = wire.MEMSET_TAIL.unpack_from(payload, wire.RPC_TENSOR_SIZE)
        start, end = buf.span(t.rpc.data + offset, n, f"MEMSET_TENSOR '{t.rpc.name}' at +{offset}")
        buf.array[start:end] = value
        self._written(buf, start, end)

    def _copy_tensor(self, size: int) -> None:
        payload = self.reader.read(size)
        src, src_buf = self._target(payload, 0, "COPY_TENSOR src")
        dst, dst_buf = self._target(payload, wire.RPC_TENSOR_SIZE, "COPY_TENSOR dst")
        n = src.end - src.start
        start, end = dst_buf.span(dst.rpc.data, n, f"COPY_TENSOR of {n} bytes into '{dst.rpc.name}'")
        dst_buf.array[start:end] = src_buf.array[src.start:src.end]   # numpy handles overlap
        self._written(dst_buf, start, end)
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
        ``replay``: a GRAPH_RECOMPUTE (counted as such, not as a plan cache hit). One turn:
        planning stages weights and runs ggml, execution runs the engine and the threadpool."""
        graphs = self.graphs[dev]
        with self.state.turns:
            plan = graphs.lookup(digest)
            if plan is None:
                self._built_plans = True
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
        with self.state.turns:
            self.state.stats.recomputes += 1
            plan.execute(self.state.stats)

    # --- the ggml-rpc-server -c style cache ---------------------------------------------------
    def _cache_load(self, t: CheckedTensor, buf: DeviceBuffer, offset: int, digest: int) -> int:
        """1 if the bytes with this FNV-1a-64 hash are in the cache (and now in the tensor)."""
        cache = self.state.config.cache_dir
        self._pending_hash = None
        if cache is None:
            return 0
        path = cache / f"{digest:016x}"
        if not path.is_file():
            self._pending_hash = (buf.handle, t.rpc.data + offset, digest)
            return 0
        n = path.stat().st_size
        start, end = buf.span(t.rpc.data + offset, n, f"SET_TENSOR_HASH '{t.rpc.name}' at +{offset}")
        with open(path, "rb") as f:
            if f.readinto(buf.array.data[start:end]) != n:
                raise ProtocolError(f"cache file {path} changed while reading")
        self._written(buf, start, end)
        return 1

    def _cache_store(self, cache: Path, buf: DeviceBuffer, addr: int, start: int, end: int) -> None:
        """Store bytes the client marked cacheable under the hash it announced for them.

        Deviation from the C++ server (documented): the name is the FNV-1a-64 the client
        sent in the SET_TENSOR_HASH that immediately preceded this write, not a hash we
        recompute; a pure-Python FNV over a model's tensors would cost seconds per 10 MiB.
        """
        pending, self._pending_hash = self._pending_hash, None
        if pending is None or pending[:2] != (buf.handle, addr):
            return
        path = cache / f"{pending[2]:016x}"
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")   # sessions may store one hash at once
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(buf.array.data[start:end])
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write the tensor cache %s: %s", path, exc)


def _keepalive(sock: socket.socket) -> None:
    """Detect a client that vanished without closing (a board across a dropped network link)
    in about 90 s, instead of holding its buffers and its thread for hours."""
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
    """Accepts clients on (host, port) and serves each in its own thread; ``serve_forever`` until ``stop``.

    ``protocol``: the RPC major every connection is answered with, or None (``--protocol auto``):
    7.0.0 on ``port`` and 8.0.0 on ``port + 1`` (any free port for both when ``port`` is 0), one
    listener per major because a client's HELLO carries no version [docs/server.md: Choosing
    the protocol]. Clients of both ports are served at once, like those of one."""

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
        majors = sorted(wire.PROTO_VERSIONS) if protocol is None else [protocol]   # None: self.auto
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
        # the sessions being served and their threads; written by the accept loop and the session
        # threads, read by ``stop`` (a signal handler: no lock, a snapshot with list())
        self._sessions: dict[Session, threading.Thread] = {}
        self._ended = threading.Condition()
        self._runs_reported = 0

    @staticmethod
    def _listen(host: str, port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(LISTEN_BACKLOG)
        except OSError:
            listener.close()
            raise
        return listener

    def serve_forever(self, poll_s: float = 0.2) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select(list(self.listeners), [], [], poll_s)
                for listener in ready:
                    self._accept(listener)
        finally:
            self._stop.set()
            for session in list(self._sessions):
                session.hang_up()
            for thread in list(self._sessions.values()):
                thread.join()
            for listener in self.listeners:
                listener.close()

    def _accept(self, listener: socket.socket) -> None:
        """Take one connection off ``listener`` and start its session thread, or refuse it at
        once (over ``max_clients``): the accept loop never waits for a client."""
        major = self.listeners[listener]
        try:
            sock, addr = listener.accept()
        except OSError:
            return
        peer = f"{addr[0]}:{addr[1]}"
        counts = self.state.sessions
        if len(self._sessions) >= self.state.config.max_clients:
            with self.state.counting:
                counts.refused_at_accept += 1
            log.warning("refusing %s: %d connections are being served (--max-clients)", peer, len(self._sessions))
            sock.close()
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
            other_port = next((p for m, p in self.ports.items() if m != major), None)
            session = Session(self.state, sock, peer, major, other_port)
        except Exception:       # a client reset before we set it up, or no memory for a session
            log.exception("cannot start a session for %s", peer)
            sock.close()
            return
        log.debug("client %s connected (protocol %d)", peer, major)
        thread = threading.Thread(target=self._serve, args=(session,), name=f"rpc {peer}", daemon=True)
        self._sessions[session] = thread
        with self.state.counting:
            counts.now = len(self._sessions)
            counts.peak = max(counts.peak, counts.now)
        if self._stop.is_set():         # stopped between the snapshot of ``stop`` and here
            session.hang_up()
        thread.start()

    def _serve(self, session: Session) -> None:
        """One session's thread: run it to its end, then report (once per new graph runs)."""
        t0 = time.perf_counter()
        try:
            session.run()
        except Exception:          # a failure while tearing a session down must not end the server
            log.exception("error while closing the session of %s", session.peer)
            session.sock.close()
        finally:
            del self._sessions[session]
            with self.state.counting:
                self.state.sessions.now = len(self._sessions)
            with self._ended:
                self._ended.notify_all()
        log.debug("client %s done after %.2f s", session.peer, time.perf_counter() - t0)
        state = self.state
        with state.counting:
            runs = state.stats.graph_runs
            report, self._runs_reported = runs != self._runs_reported, runs   # not after every memory probe
        if report:
            if state.config.stats_each_client:
                log.info("\n%s", state.render_stats())
            state.write_stats_json()

    def wait_idle(self, timeout: float = 30.0, leave: int = 0) -> bool:
        """Wait until at most ``leave`` sessions are being served (tests: a client's session has
        freed everything once it returns True)."""
        with self._ended:
            return self._ended.wait_for(lambda: len(self._sessions) <= leave, timeout)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def stop(self) -> None:
        """Stop now (SIGTERM / SIGINT handlers, or any thread): hang up on every client, whose
        sessions then free everything through their own path, and return from ``serve_forever``
        once they have.

        A handler must not raise instead: CPython runs it between any two bytecodes of the main
        thread, so its exception would unwind the data plane anywhere, e.g. between a free and
        the reset of the freed handle, and the unwinding would free it again (docs/server.md
        "Stopping"). No lock here either: the handler may interrupt the thread that holds it."""
        self._stop.set()
        for session in list(self._sessions):
            session.hang_up()
