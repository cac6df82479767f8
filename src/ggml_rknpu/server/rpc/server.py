"""One client connection of the ggml RPC server llama.cpp talks to with ``--rpc host:port``
(protocol 7.0.0 or 8.0.0, one major per connection), behaving like the C++ ``ggml-rpc-server``
where the client depends on it [docs/ggml-rpc.md §3, §4, P6, P7]; ``listener.RpcServer`` accepts.

Invariants: a session blocks only in its own socket I/O or waiting for its turn (``server.turns``:
FIFO, never held across I/O), so a stalled or hostile client costs the others nothing; commands
strictly in order, replies only for commands that have one; HELLO first; a bad request (a second
HELLO, an unknown command or handle, a wrong size, a tensor outside its buffer, an unsupported op)
gets a logged reason, ``shutdown(SHUT_RDWR)`` and close, never the server's death; buffers belong
to the connection, staged weights are shared by content (``live_weights``). The handlers:
``buffer_commands``, ``tensor_commands``, ``proto8``; HELLO and the graphs are here."""

from __future__ import annotations

import gc
import logging
import socket
from collections.abc import Callable

from ggml_rknpu.server.buffers import BufferTable, RpcBuffer
from ggml_rknpu.server.plan_cache import DeviceGraphs, graph_digest
from ggml_rknpu.server.planner import GraphPlanner
from ggml_rknpu.server.recovery import NpuRecovery
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.buffer_commands import BufferCommands
from ggml_rknpu.server.rpc.deadlines import ClientGone, Deadlines, IdleTimeout, Reader, Stalled, TooSlow
from ggml_rknpu.server.rpc.proto8 import Proto8
from ggml_rknpu.server.rpc.state import ServerState
from ggml_rknpu.server.rpc.tensor_commands import TensorCommands
from ggml_rknpu.server.rpc.wire import Cmd, ProtocolError
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor, check_tensor
from ggml_rknpu.server.weight_store import WeightStore

log = logging.getLogger("ggml_rknpu.rpc")


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
                                   state.retired, state.live, budget=state.budget)
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
        self._built_plans = False         # this connection planned a graph (its close collects cycles)
        self.clean_end = False            # a goodbye at a message boundary: its staged weights are retired
        self.commands_after_hello = 0
        self.buffer_commands = BufferCommands(self)
        self._handlers: dict[int, Callable[[int], None]] = {
            Cmd.HELLO: self._hello, Cmd.GRAPH_COMPUTE: self._graph_compute,
            Cmd.GRAPH_RECOMPUTE: self._graph_recompute,
            **self.buffer_commands.handlers(), **TensorCommands(self).handlers(),
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
        self.buffer_commands.close()

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
            self.planner.residency.close()
            # A session that built plans leaves reference cycles holding views of its buffers
            # (22 unreachable objects per small client with GraphPlan), and the handler table
            # and the command objects hold the session: without a collection here a client's
            # compute buffers would outlive it until the next full cyclic collection (RSS grew
            # ~80 KiB per small client in tests/server/test_rpc_churn.py).
            # Only sessions that built plans pay for it (not llama.cpp's memory probes).
            self._handlers.clear()
            if self._built_plans:      # inside the turn: what the collection frees may reach the engine
                gc.collect()

    # --- what the command handlers share (connection.Connection) --------------------------
    def send(self, payload: bytes) -> None:
        self.deadlines.send(wire.pack_response(payload))
        self.count_out(len(payload) + 8)

    def count_out(self, n: int) -> None:
        with self.state.counting:
            self.state.stats.bytes_out += n

    def device(self, dev: int, what: str) -> int:
        if dev >= self.state.config.n_devices:
            raise ProtocolError(f"{what}: device {dev} does not exist ({self.state.config.n_devices} device(s))")
        return dev

    def target(self, payload: bytes, offset: int, what: str) -> tuple[CheckedTensor, RpcBuffer]:
        """The checked tensor at ``offset`` and the buffer it lies in (ProtocolError: none here)."""
        t = RpcTensor.unpack_from(payload, offset)
        checked = check_tensor(t, self.buffers, what)
        if checked.buffer is None:
            raise ProtocolError(f"{what} '{t.name}': tensor has no buffer on this server")
        return checked, checked.buffer

    def written(self, buf: RpcBuffer, start: int, end: int) -> None:
        if end > start:
            with self.state.turns:
                self.weights.invalidate(buf, start, end)
                self.planner.host_copies.invalidate(buf, start, end)

    def _on_free(self, buf: RpcBuffer) -> None:
        self.buffer_commands.freed(buf)
        self.weights.drop_buffer(buf)
        for g in self.graphs:          # like the C++ server: any FREE_BUFFER drops stored graphs
            g.clear()
        self.planner.host_copies.drop_buffer(buf)
        self.planner.residency.drop_buffer(buf.handle)
        if self.proto8 is not None:
            self.proto8.on_free()

    # --- commands -------------------------------------------------------------------------
    def _hello(self, size: int) -> None:
        self.reader.read(size)
        if self.hello:
            raise ProtocolError("second HELLO in one connection")
        self.hello = True
        major, minor, patch = wire.PROTO_VERSIONS[self.major]
        self.send(wire.HELLO_RSP.pack(major, minor, patch, 0, bytes(24)))   # zero caps: TCP only

    def _graph_compute(self, size: int) -> None:
        payload = self.reader.read(size)
        (dev,) = wire.DEV_REQ.unpack_from(payload, 0)
        self.compute_graph(self.device(dev, "GRAPH_COMPUTE"), payload, graph_digest(payload))

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
        plan = self.graphs[self.device(dev, "GRAPH_RECOMPUTE")].last
        if plan is None:
            raise ProtocolError(f"GRAPH_RECOMPUTE on device {dev} without a stored graph")
        with self.state.turns:
            self.state.stats.recomputes += 1
            plan.execute(self.state.stats)
