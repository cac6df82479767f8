"""A hostile or broken PEER on the server-to-server link of COMM_INIT / COMM_ALLREDUCE: the
server under test plays rank 0 or rank 1, and a scripted socket plays the other rank.

The link has no framing (docs/ggml-rpc.md §4.6): 24 bytes of caps each way (rank 1 first),
then per all-reduce the tensor's bytes each way (raw f32, BF16 from 32768 elements; rank 0
first). So a broken peer can only send too little (then close, reset or stall), too much, or
the wrong count (a tensor of another element count or wire type on its side), or stay silent;
any bytes of the right count are a valid tensor, garbage included, and must be summed exactly.

After each case: a join the peer spoiled is answered 0 with a logged reason and the session
goes on; an all-reduce it spoiled closes that session with a logged reason; a valid exchange
sums exactly, twice in a row (the link stays in step). Then a new client of the same server
computes a graph exactly, the peer's thread has ended (a bounded join), and the process has
the file descriptors and threads it had before the case.

The CI share is the table of every behaviour at both ranks plus a few random cases (~30 s
here); the slow sweep closes the link at every byte of the caps and of a small tensor, and
draws 600 random cases.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import comm
from ggml_rknpu.server.rpc.wire import Cmd
from ggml_rknpu.toolchain.launch import free_port
from support.matmul_graph import f32
from support.rpc_testkit import FakeNpu, RpcClient, ServerClosed, ServerThread, T

pytestmark = pytest.mark.timeout(300)
STALL_S = 0.5                  # the server's stall timeout: what a silent peer costs
PEER_WAIT_S = 5.0              # the scripted peer's own limit on any wait (never reached on a pass)
CAPS_MODES = ("ok", "short_close", "short_stall", "more", "silent", "reset")
DATA_MODES = ("ok", "short_close", "short_stall", "more", "silent", "close_first", "reset", "count",
              "send_then_close")
SIZES = (1, 7, 256, comm.BF16_FROM_ELEMENTS)


def wire_bytes(n: int) -> int:
    return 2 * n if n >= comm.BF16_FROM_ELEMENTS else 4 * n


def decode(raw: bytes, n: int) -> np.ndarray:
    """What the server makes of a peer's tensor of ``n`` elements."""
    if n >= comm.BF16_FROM_ELEMENTS:
        return comm.bf16_to_fp32(np.frombuffer(raw, np.uint16))
    return np.frombuffer(raw, np.float32)


def encode(values: np.ndarray) -> bytes:
    return (comm.fp32_to_bf16(values) if values.size >= comm.BF16_FROM_ELEMENTS else values).tobytes()


@dataclass(frozen=True)
class PeerCase:
    """One scripted peer. ``k``: the bytes of a short or surplus send, or (``count``) the
    element count the peer's tensor has; ``bad_round``: the all-reduce (0 or 1) the data mode
    spoils, the ones before it are valid."""

    server_rank: int
    n: int
    caps: str = "ok"
    data: str = "ok"
    k: int = 1
    bad_round: int = 0
    seed: int = 0

    @property
    def w(self) -> int:
        return wire_bytes(self.n)

    @property
    def short(self) -> int:
        """A short send: fewer bytes than the phase needs."""
        need = comm.CAPS_SIZE if self.caps != "ok" else self.w
        return min(self.k, need - 1)

    @property
    def surplus(self) -> bytes:
        """A surplus send: at least one byte more than asked."""
        return bytes(max(1, self.k))

    @property
    def peer_n(self) -> int:
        """The element count of the peer's tensor in the ``count`` mode (never the server's)."""
        return self.k if self.k != self.n else self.n + 1

    @property
    def rounds(self) -> int:
        return 2 if self.data == "ok" else self.bad_round + 1

    @property
    def label(self) -> str:
        return f"rank{self.server_rank}-n{self.n}-caps_{self.caps}-data_{self.data}-k{self.k}-round{self.bad_round}"

    def expect(self) -> str:
        """'init0', 'closed', 'sum', or 'either' (the peer's bytes were whole; whether the
        server's reply reached it first is a race the peer lost)."""
        if self.caps != "ok":
            return "init0"
        if self.data == "ok":
            return "sum"
        if self.data == "send_then_close":       # the peer's tensor was whole; then it hung up
            return "either" if self.server_rank == 1 else "sum"
        if self.data == "count" and wire_bytes(self.peer_n) == self.w:
            return "sum"                # the same bytes on the wire: a valid tensor to this link
        return "closed"


class Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def find(self, *words: str) -> str:
        return next((line for line in reversed(self.lines) if all(w in line for w in words)), "")


@dataclass
class Rig:
    srv: ServerThread
    log: Log
    outcomes: Counter = field(default_factory=Counter)     # printed at the end: the cases by outcome


@pytest.fixture(scope="module")
def rig():
    s = ServerThread(npu=FakeNpu(), protocol=8, stall_timeout_s=STALL_S)
    log = Log()
    logger = logging.getLogger("ggml_rknpu.rpc")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    rig = Rig(s, log)
    yield rig
    print(f"\nCOMM peer fuzz: {sum(rig.outcomes.values())} cases, by outcome {dict(rig.outcomes)}")
    logger.removeHandler(log)
    logger.setLevel(level)
    s.stop()


class Peer:
    """The other rank, as a thread running ``case``'s script; ``go[r]`` is set when the client
    sends round r's COMM_ALLREDUCE (a rank 0 must not speak before its client asks it to)."""

    def __init__(self, case: PeerCase, port: int) -> None:
        self.case, self.port = case, port
        self.rng = np.random.default_rng(case.seed)
        self.go = [threading.Event() for _ in range(case.rounds)]
        self.done = [threading.Event() for _ in range(case.rounds)]     # round r ended as a valid one
        self.release = threading.Event()
        self.sent: list[bytes] = []                 # per round: the tensor bytes the peer sent
        self.received: list[bytes] = []
        self.error: BaseException | None = None
        self.listener: socket.socket | None = None
        if case.server_rank == 1:                   # the peer is rank 0: it listens before COMM_INIT
            self.listener = socket.create_server(("127.0.0.1", port))
            self.listener.settimeout(PEER_WAIT_S)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock = None
        try:
            sock = self._join()
            sock.settimeout(PEER_WAIT_S)
            if self._caps(sock):
                for r in range(self.case.rounds):
                    if not self.go[r].wait(PEER_WAIT_S) or not self._round(sock, r):
                        break
            self.release.wait(PEER_WAIT_S)           # a peer keeps its end open until the case ends
        except OSError:
            pass                                     # the server closed the link: its side is judged
        except BaseException as exc:                 # a bug in this script: reported by the test
            self.error = exc
        finally:
            if sock is not None:
                sock.close()
            if self.listener is not None:
                self.listener.close()

    def _join(self) -> socket.socket:
        if self.listener is not None:
            sock, _ = self.listener.accept()
            return sock
        deadline = time.monotonic() + PEER_WAIT_S
        while True:                                  # rank 1 retries until rank 0 listens
            try:
                return socket.create_connection(("127.0.0.1", self.port), timeout=PEER_WAIT_S)
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _recv(self, sock: socket.socket, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def _hold(self) -> bool:
        self.release.wait(PEER_WAIT_S)
        return False

    def _reset(self, sock: socket.socket) -> bool:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False                                 # the close in _run then sends an RST

    def _caps(self, sock: socket.socket) -> bool:
        """Rank 1 speaks first, rank 0 answers; False when the script ends here."""
        c = self.case
        if c.server_rank == 1:
            self._recv(sock, comm.CAPS_SIZE)
        mode = c.caps
        if mode == "silent":
            return self._hold()
        if mode == "reset":
            return self._reset(sock)
        if mode in ("short_close", "short_stall"):
            sock.sendall(self.rng.bytes(c.short))
            return self._hold() if mode == "short_stall" else False
        sock.sendall(self.rng.bytes(comm.CAPS_SIZE) + (c.surplus if mode == "more" else b""))   # any caps: TCP
        if c.server_rank == 0:
            return len(self._recv(sock, comm.CAPS_SIZE)) == comm.CAPS_SIZE
        return mode == "ok"

    def _round(self, sock: socket.socket, r: int) -> bool:
        c = self.case
        mode = c.data if r == c.bad_round else "ok"
        w = wire_bytes(c.peer_n) if mode == "count" else c.w
        if mode == "close_first":
            return False
        if mode == "reset":
            return self._reset(sock)
        if c.server_rank == 0:                       # the peer is rank 1: it receives first
            self.received.append(self._recv(sock, w))
        if mode == "silent":
            return self._hold()
        if mode in ("short_close", "short_stall"):
            sock.sendall(self.rng.bytes(c.short))
            return self._hold() if mode == "short_stall" else False
        tensor = self.rng.bytes(w)                   # garbage bytes are a valid tensor (NaNs too)
        self.sent.append(tensor)
        sock.sendall(tensor + (c.surplus if mode == "more" else b""))
        if mode == "send_then_close":
            return False
        if c.server_rank == 1:
            self.received.append(self._recv(sock, w))
        self.done[r].set()
        return True

    def end(self) -> None:
        self.release.set()
        for e in self.go:
            e.set()
        self.thread.join(PEER_WAIT_S * 2)
        assert not self.thread.is_alive(), "the scripted peer is still waiting: something hung"
        assert self.error is None, f"the peer script failed: {self.error!r}"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settles(measure, target: int, timeout: float = 5.0) -> int:
    """``measure()`` once it is at most ``target`` (sessions close on their own thread)."""
    deadline = time.monotonic() + timeout
    while (got := measure()) > target and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def _serves_a_new_client(srv) -> None:
    """DEVICE_COUNT, and an ADD with a uid computed and recomputed exactly."""
    a_v, b_v = np.arange(16, dtype=np.float32), np.full(16, 0.25, np.float32)
    with srv.client() as c:
        assert c.device_count() == 1
        h, base = c.alloc_base(256)
        a, b = f32(h, base, 16), f32(h, base + 64, 16)
        out = f32(h, base + 128, 16, op=int(GgmlOp.ADD), src=(a.id, b.id))
        c.set_array(a, a_v)
        c.set_array(b, b_v)
        c.graph_compute([out], [a, b, out], uid=7)
        c.set_array(a, a_v * 2)
        c.graph_recompute(uid=7)
        assert np.array_equal(c.get_array(out).ravel(), a_v * 2 + b_v)


def _allreduce(c: RpcClient, t: T) -> None:
    c.send(Cmd.COMM_ALLREDUCE, struct.pack("<I", 0) + t.pack())


def run_case(rig: Rig, case: PeerCase) -> str:
    """Play ``case``, check the session's outcome and the server after it; the outcome."""
    srv, log = rig.srv, rig.log
    fds, threads = _fds(), threading.active_count()
    port = free_port()
    values = np.random.default_rng(case.seed + 1).standard_normal(case.n).astype(np.float32)
    expect = case.expect()
    c = srv.client()
    session = f"127.0.0.1:{c.sock.getsockname()[1]}"
    peer = None
    try:
        h, base = c.alloc_base(values.nbytes)
        t = f32(h, base, case.n, name="partial")
        c.set_array(t, values)
        peer = Peer(case, port)
        ok = c.comm_init(rank=case.server_rank, world=2, port=port, host="127.0.0.1" if case.server_rank else "")
        if not ok:
            assert expect == "init0", f"{case}: COMM_INIT answered 0"
            assert log.find(session, "COMM_INIT refused"), f"{case}: no logged reason for the 0"
            assert c.device_count() == 1                # the session goes on (the client falls back)
            outcome = "init0"
        else:
            assert expect != "init0", f"{case}: the server joined a peer that broke the caps exchange"
            outcome = "sum"
            for r in range(case.rounds):
                sent_values = values.copy()
                _allreduce(c, t)
                peer.go[r].set()
                try:
                    got = np.frombuffer(c.get_tensor(t), np.float32)
                except (ServerClosed, ConnectionResetError, BrokenPipeError):
                    outcome = "closed"
                    break
                assert r < case.bad_round or expect in ("sum", "either"), f"{case}: round {r} was summed"
                if not (case.data == "send_then_close" and r == case.bad_round):   # it hung up unread
                    assert peer.done[r].wait(PEER_WAIT_S), f"{case}: round {r} hung in the peer"
                    assert peer.received[r] == encode(sent_values), f"{case}: the server sent other bytes"
                with np.errstate(over="ignore", invalid="ignore"):
                    values = values + decode(peer.sent[r][:case.w], case.n)
                np.testing.assert_array_equal(got, values, err_msg=f"{case}: round {r}")
            if outcome == "closed":
                assert expect in ("closed", "either"), f"{case}: the session was closed"
                reason = log.find(f"closing {session}", "COMM_ALLREDUCE")
                assert reason, f"{case}: closed without a logged reason:\n" + "\n".join(log.lines[-5:])
            else:
                c.send(Cmd.COMM_FREE, struct.pack("<I", 0))
                assert c.device_count() == 1
    finally:
        c.close()
        if peer is not None:
            peer.end()
    _serves_a_new_client(srv)
    assert _settles(_fds, fds) <= fds, f"{case}: {_fds() - fds} file descriptor(s) left open"
    assert _settles(threading.active_count, threads) <= threads, f"{case}: a thread is left"
    rig.outcomes[outcome] += 1
    return outcome


def table() -> list[PeerCase]:
    """Every caps and data behaviour at both ranks; wrong counts across the BF16 threshold."""
    big = comm.BF16_FROM_ELEMENTS
    cases = []
    for rank in (0, 1):
        cases += [PeerCase(rank, 7, caps=mode, k=k) for mode in CAPS_MODES if mode != "ok"   # ok: the data rows
                  for k in ((0, 23) if "short" in mode else (1,))]
        cases += [PeerCase(rank, 7, data=mode, k=k) for mode in DATA_MODES if mode != "count"
                  for k in ((0, 27) if "short" in mode else (1,))]
        cases += [PeerCase(rank, n, data="count", k=k) for n, k in ((7, 6), (7, 8), (big, big - 1), (big - 1, big))]
        cases += [PeerCase(rank, big), PeerCase(rank, big, data="more", k=1), PeerCase(rank, big, data="short_close",
                                                                                       k=big),
                  PeerCase(rank, 7, data="short_close", k=5, bad_round=1), PeerCase(rank, 7, data="more", bad_round=1)]
    return cases


@pytest.mark.parametrize("case", table(), ids=lambda c: c.label)
def test_peer_behaviour(rig, case):
    outcome = run_case(rig, case)
    assert outcome == case.expect() or case.expect() == "either"


# caps "ok" about half the time, so that most cases reach the all-reduce
_CASES = st.builds(PeerCase, server_rank=st.integers(0, 1), n=st.sampled_from(SIZES),
                   caps=st.one_of(st.just("ok"), st.sampled_from(CAPS_MODES)),
                   data=st.sampled_from(DATA_MODES), k=st.integers(0, 70000), bad_round=st.integers(0, 1),
                   seed=st.integers(0, 1 << 30))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_CASES)
def test_random_peers(rig, case):
    outcome = run_case(rig, case)
    assert outcome == case.expect() or case.expect() == "either"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("rank", [0, 1])
def test_close_at_every_byte_slow(rig, rank):
    """The link closed after every byte count of the caps, and of both directions of a 7-element
    tensor's exchange (rounds 0 and 1)."""
    for k in range(comm.CAPS_SIZE):
        assert run_case(rig, PeerCase(rank, 7, caps="short_close", k=k)) == "init0"
    for bad_round in (0, 1):
        for k in range(wire_bytes(7)):
            assert run_case(rig, PeerCase(rank, 7, data="short_close", k=k, bad_round=bad_round)) == "closed"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_CASES)
def test_random_peers_slow(rig, case):
    outcome = run_case(rig, case)
    assert outcome == case.expect() or case.expect() == "either"


@pytest.mark.parametrize("what", ["nobody listens", "nobody connects", "port taken", "host IDNA cannot encode"])
def test_no_peer_is_answered_0_not_hung(rig, what):
    """Without a peer the join is answered 0 after at most the stall timeout, with a reason."""
    srv = rig.srv
    fds = _fds()
    port = free_port()
    taken = socket.create_server(("127.0.0.1", port)) if what == "port taken" else None
    rank, host = {"nobody listens": (1, "127.0.0.1"), "nobody connects": (0, ""), "port taken": (0, ""),
                  "host IDNA cannot encode": (1, "a" * 64)}[what]
    try:
        with srv.client() as c:
            session = f"127.0.0.1:{c.sock.getsockname()[1]}"
            t0 = time.monotonic()
            assert c.comm_init(rank=rank, world=2, port=port, host=host) == 0
            assert time.monotonic() - t0 < STALL_S + 1.0
            assert rig.log.find(session, "COMM_INIT refused")
            assert c.device_count() == 1
    finally:
        if taken is not None:
            taken.close()
    _serves_a_new_client(srv)
    assert _settles(_fds, fds) <= fds
    rig.outcomes["init0"] += 1
