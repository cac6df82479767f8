"""``RpcServer``: the accept loop of ``rknpu serve``. It listens on (host, port), one listener
per protocol major, and serves every connection at once in its own thread (a ``server.Session``),
refusing one over ``--max-clients`` at accept; ``stop`` hangs up on every client and returns once
their sessions have freed everything. Why threads: docs/server.md "Concurrent sessions"."""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import threading
import time

from ggml_rknpu.server.rpc import report, wire
from ggml_rknpu.server.rpc.server import Session
from ggml_rknpu.server.rpc.state import ServerState

log = logging.getLogger("ggml_rknpu.rpc")

LISTEN_BACKLOG = 128         # connections the kernel queues while the accept loop catches up


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
            new_runs, self._runs_reported = runs != self._runs_reported, runs   # not after every memory probe
        if new_runs:
            if state.config.stats_each_client:
                log.info("\n%s", report.render_stats(state))
            report.write_stats_json(state)

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
