"""Malformed graphs never get through, judged by AddressSanitizer: `rknpu serve` runs on the
ASan build of libggml-base/libggml-cpu (scripts/build-ggml --asan; scripts/test builds it), and
per admitted op (one node as ggml's own builder makes it, support.malformed) the test sends
graphs with wrong shapes, strides, types, op_params, missing sources and out-of-range index
data. It asserts: the server never dies, AddressSanitizer reports nothing (its log directory
stays empty), every graph that is always wrong is refused with a logged reason, one that may be
valid is refused or computed (and then read nothing out of bounds: ASan would have said so),
and after every graph the server still computes a good one exactly.

Every tensor goes in its own server buffer of exactly its span, so a kernel reading past a
tensor leaves the allocation and hits an ASan redzone. Python itself is not instrumented: the
compiler's libasan is preloaded (the instrumented libraries need its runtime first), leaks
are not checked (the interpreter keeps its allocations to the end), and the first report
aborts the server (halt_on_error, abort_on_error), which the test sees as a crash.
test_sanitizer_sees_an_out_of_bounds_read shows that this set-up does report a real overflow.

The same judge on protocol 8.0.0 (`rknpu serve --protocol 8`): every case as a GRAPH_COMPUTE
with a uid under mutations, each computed one replayed by the 12-byte GRAPH_RECOMPUTE; the uid
paths (known, unknown, 0, after FREE_BUFFER, another device, the clear at 1024 uids);
SET_TENSOR_2D / GET_TENSOR_2D rows on both sides of a tensor's end; COMM_INIT that cannot pair,
COMM_ALLREDUCE with a well-behaved peer (exact sums) and of bad tensors, COMM_FREE; and random
and byte-flipped 8.0.0 requests. After each: no report, the server alive, a good graph exact.

The CI tests send every case once per mutation on 7.0.0 (758 graphs) and twice on 8.0.0, and
the 8.0.0 requests above (~40 s in all here); the slow ones sweep 32 values per mutation
(8 on 8.0.0), chain up to three random mutations per graph, and send 1500 random and mutated
8.0.0 requests. The numbers are in docs/server.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.ops.rules import RULES
from ggml_rknpu.server.rpc import comm, wire
from ggml_rknpu.server.rpc.wire import Cmd
from ggml_rknpu.toolchain import llamacpp
from ggml_rknpu.toolchain.launch import free_port
from support.malformed import BAD, MUTATIONS, Case, builder_cases, mutate, send, still_talking
from support.rpc_testkit import RpcClient, ServerClosed, T, graph_payload, wait_for_line

pytestmark = pytest.mark.timeout(600)
# ops the sweep must reach: every index-reading op, and the families of tests/server/ops (a floor, so a
# rule added without a builder case does not silently shrink the sweep)
MUST_COVER = frozenset({GgmlOp.GET_ROWS, GgmlOp.SET_ROWS, GgmlOp.MUL_MAT_ID, GgmlOp.ADD_ID, GgmlOp.SSM_SCAN,
                        GgmlOp.MUL_MAT, GgmlOp.ROPE, GgmlOp.SOFT_MAX, GgmlOp.FLASH_ATTN_EXT, GgmlOp.CPY,
                        GgmlOp.GLU, GgmlOp.UNARY, GgmlOp.RMS_NORM, GgmlOp.CONCAT, GgmlOp.IM2COL,
                        GgmlOp.GATED_DELTA_NET, GgmlOp.RWKV_WKV7, GgmlOp.ARGSORT, GgmlOp.TOP_K})
GRAPH_UID = 5                  # 8.0.0: the uid each mutated graph is sent with (ignored on 7.0.0)


def _asan_runtime(lib_dir: Path) -> Path:
    """The libasan of the compiler that built the variant (its CMakeCache names the compiler)."""
    cache = (lib_dir.parent / "CMakeCache.txt").read_text()
    cc = re.search(r"^CMAKE_C_COMPILER:\w+=(.+)$", cache, re.M)
    compiler = cc.group(1).strip() if cc else "gcc"
    path = Path(subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True,
                               check=True).stdout.strip())
    assert path.is_absolute() and path.exists(), f"{compiler} has no libasan.so ({path})"
    return path


@pytest.fixture(scope="module")
def asan_lib_dir() -> Path:
    lib_dir = llamacpp.ggml_build_dir("asan")
    if not all((lib_dir / name).is_file() for name in llamacpp.GGML_LIBS):
        pytest.skip(f"the AddressSanitizer build of ggml is not in {lib_dir}: run scripts/build-ggml --asan "
                    "(scripts/test does)")
    return lib_dir


def _asan_env(lib_dir: Path, log_dir: Path) -> dict[str, str]:
    """The environment of a process on the ASan ggml whose reports go to ``log_dir``."""
    return {**os.environ, llamacpp.GGML_LIB_DIR_ENV: str(lib_dir), "LD_PRELOAD": str(_asan_runtime(lib_dir)),
            "ASAN_OPTIONS": f"detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path={log_dir}/asan",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "GGML_NO_BACKTRACE": "1"}       # a GGML_ABORT dies at once (no gdb attached for a backtrace)


def _reports(log_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(log_dir.iterdir()))


class AsanServer:
    """`rknpu serve --device host` (every op on the ASan ggml-cpu) in a subprocess, its log read
    by a thread."""

    def __init__(self, lib_dir: Path, tmp: Path, protocol: int = 7, stall_timeout_s: float = 5.0) -> None:
        self.log_dir, self.stats_json = tmp / "asan-logs", tmp / "stats.json"
        self.log_dir.mkdir()
        self.major = protocol
        env = _asan_env(lib_dir, self.log_dir)
        self.proc = subprocess.Popen([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0",
                                      "--device", "host", "-t", "1", "--stall-timeout", str(stall_timeout_s),
                                      "--protocol", str(protocol), "--stats-json", str(self.stats_json)],
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.port = int(wait_for_line(self.proc, r"on 127\.0\.0\.1:(\d+)", self.lines, timeout=120).group(1))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def client(self) -> RpcClient:
        return RpcClient(self.port, major=self.major)

    def check(self, what: str) -> None:
        """The server is alive and ASan has said nothing (else: fail naming the graph)."""
        if self.proc.poll() is not None or any(self.log_dir.iterdir()):
            try:
                self.proc.wait(timeout=10)     # abort_on_error: ASan's report is whole once the server is gone
            except subprocess.TimeoutExpired:
                pass
            pytest.fail(f"after {what}: server exit {self.proc.poll()}, sanitizer reports:\n"
                        f"{_reports(self.log_dir)[:6000]}\nserver log tail:\n{''.join(self.lines[-20:])}")

    def reason(self, port: int, timeout: float = 5.0) -> str:
        """The line where the server said why it closed the client on local port ``port``."""
        pattern = re.compile(rf"closing 127\.0\.0\.1:{port}\b")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in reversed(self.lines):
                if pattern.search(line):
                    return line
            time.sleep(0.01)
        return ""

    def stop(self) -> dict:
        """SIGTERM; the exit status must be 0; the counters it wrote at exit."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self._reader.join(timeout=10)
        assert code == 0, f"rknpu serve exited {code}:\n{''.join(self.lines[-30:])}"
        return json.loads(self.stats_json.read_text())


@pytest.fixture(scope="module")
def server(asan_lib_dir, tmp_path_factory):
    s = AsanServer(asan_lib_dir, tmp_path_factory.mktemp("asan-serve"))
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


@pytest.fixture(scope="module")
def cases(host_ggml):
    return builder_cases(host_ggml)


def _good_graph(server: AsanServer) -> None:
    """ADD of two known vectors computes exactly (each tensor in its own buffer); on 8.0.0 by
    uid, then replayed by GRAPH_RECOMPUTE on new values."""
    a = np.arange(256, dtype=np.float32)
    b = np.full(256, 0.5, dtype=np.float32)
    with server.client() as c:
        (ha, pa), (hb, pb), (hc, pc) = (c.alloc_base(1024) for _ in range(3))
        ta, tb = T(ne=(256, 1, 1, 1), buffer=ha, data=pa), T(ne=(256, 1, 1, 1), buffer=hb, data=pb)
        tc = T(ne=(256, 1, 1, 1), buffer=hc, data=pc, op=int(GgmlOp.ADD), src=(ta.id, tb.id))
        c.set_array(ta, a)
        c.set_array(tb, b)
        c.graph_compute([tc], [ta, tb, tc], uid=1)
        np.testing.assert_array_equal(c.get_array(tc).ravel(), a + b)
        if server.major == 8:
            c.set_array(tb, -b)
            c.graph_recompute(uid=1)
            np.testing.assert_array_equal(c.get_array(tc).ravel(), a - b)


@dataclasses.dataclass
class Tally:
    sent: int = 0
    refused: int = 0
    computed: int = 0                                   # graphs a MAYBE mutation left valid
    recomputed: int = 0                                 # 8.0.0: computed graphs replayed by their uid
    ops: set = dataclasses.field(default_factory=set)
    by_mutation: Counter = dataclasses.field(default_factory=Counter)

    def __repr__(self) -> str:                          # hypothesis prints the fixture on a failure
        return f"Tally({self.sent} sent)"

    def describe(self) -> str:
        covered = len(self.ops & set(RULES))
        replayed = f", {self.recomputed} replayed by uid" if self.recomputed else ""
        return (f"{self.sent} graphs sent, {self.refused} refused with a logged reason, {self.computed} computed "
                f"(still valid){replayed}, ops {covered}/{len(RULES)} admitted ops; "
                f"per mutation {dict(self.by_mutation)}")


def _probe(server: AsanServer, tally: Tally, case: Case, hows: tuple[str, ...], value: int) -> None:
    node, srcs, bad_index = case.node, case.srcs, None
    for how in hows:
        mutated = mutate(Case(case.label, node, srcs, case.index), how, value)
        if mutated is None:
            return
        node, srcs, bad = mutated
        bad_index = bad if bad is not None else bad_index
    what = f"{case.label}: {' + '.join(hows)} ({value})"
    with server.client() as c:
        port = c.sock.getsockname()[1]
        try:
            send(c, node, srcs, case.index, bad_index, separate=True, uid=GRAPH_UID)
            computed = still_talking(c)
            if computed and server.major == 8:          # the stored graph, replayed: admitted again
                c.graph_recompute(uid=GRAPH_UID)
                assert still_talking(c), f"{what}: its replay by uid was refused"
                tally.recomputed += 1
        except (ServerClosed, BrokenPipeError, ConnectionResetError):
            computed = False                            # refused before the graph (a tensor out of its buffer)
    server.check(what)
    tally.sent += 1
    tally.ops.add(case.node.op)
    tally.by_mutation.update(hows)
    if computed:
        # one BAD mutation alone is always wrong; chained with others it may cancel out (a dst
        # shape and a source shape that agree again): then only ASan judges
        assert not all(h in BAD for h in hows), f"{what}: a bad graph was computed"
        tally.computed += 1
    else:
        assert server.reason(port), f"{what}: closed without a logged reason"
        tally.refused += 1
    _good_graph(server)
    server.check(f"the good graph after {what}")


def _finish(server: AsanServer, tally: Tally, cases: list[Case]) -> None:
    print(f"\nASan fuzz: {tally.describe()}")
    covered = {c.node.op for c in cases}
    missing = sorted(GgmlOp(op).name for op in MUST_COVER - covered)
    assert not missing, f"no builder case for {missing}"
    assert tally.refused > 0 and tally.ops >= set(MUST_COVER)


def test_sanitizer_sees_an_out_of_bounds_read(asan_lib_dir, tmp_path):
    """The control: the same set-up reports ggml-cpu reading past a buffer (a SCALE of a tensor
    four times larger than its memory, called directly, without the validator)."""
    env = _asan_env(asan_lib_dir, tmp_path)
    script = (
        "import ctypes, numpy as np\n"
        "from ggml_rknpu.libggml import abi, lib\n"
        "from ggml_rknpu.libggml.enums import GgmlType\n"
        "g = lib.load()\n"
        "assert 'asan' in str(g.lib_dir), g.lib_dir\n"
        "ctx = g.context(4, (2,))\n"
        "a = g.new_tensor(ctx, GgmlType.F32, (4096, 1, 1, 1))\n"
        "small, out = np.zeros(1024, np.float32), np.zeros(4096, np.float32)\n"
        "a.contents.data = small.ctypes.data\n"
        "s = g.ggml_scale(ctx, a, 2.0)\n"
        "s.contents.data = out.ctypes.data\n"
        "s.contents.flags |= abi.GGML_TENSOR_FLAG_COMPUTE\n"
        "graph = g.ggml_new_graph_custom(ctx, 2, False)\n"
        "g.ggml_graph_add_node(graph, s)\n"
        "plan = g.ggml_graph_plan(graph, 1, None)\n"
        "g.ggml_graph_compute(graph, ctypes.byref(plan))\n"
        "print('not caught')\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    report = _reports(tmp_path)
    assert proc.returncode != 0 and "not caught" not in proc.stdout, proc.stdout + proc.stderr
    assert "heap-buffer-overflow" in report and "READ" in report, report[:3000] or proc.stderr[-3000:]


def test_every_mutation_of_every_case_is_refused_or_safe(server, cases):
    """CI: every builder case under every mutation once (value 1; 'index' ones only where the op
    reads indices)."""
    tally = Tally()
    for case in cases:
        for how in MUTATIONS:
            _probe(server, tally, case, (how,), 1)
    _finish(server, tally, cases)
    stats = server.stop()
    assert not _reports(server.log_dir), _reports(server.log_dir)[:6000]
    assert stats["rejected"] + stats["unsupported"] == tally.refused      # the server counted each refusal


@pytest.fixture(scope="module")
def slow_server(asan_lib_dir, tmp_path_factory, cases):
    """One server and one tally for the slow tests; the figures and the exit checks at the end."""
    s = AsanServer(asan_lib_dir, tmp_path_factory.mktemp("asan-serve-slow"))
    tally = Tally()
    yield s, tally
    try:
        _finish(s, tally, cases)
        s.stop()
        assert not _reports(s.log_dir), _reports(s.log_dir)[:6000]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_mutation_with_many_values_slow(slow_server, cases):
    """Every case under every mutation with 32 values (which source, dimension, type, stride)."""
    server, tally = slow_server
    for case in cases:
        for how in MUTATIONS:
            for value in range(32):
                _probe(server, tally, case, (how,), value)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(pick=st.integers(0, 10_000), hows=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3, unique=True),
       value=st.integers(0, 1 << 20))
def test_chained_mutations_slow(slow_server, cases, pick, hows, value):
    """Random values, and up to three different mutations chained in one graph (the same one twice
    could undo itself: a dst type changed and changed back)."""
    server, tally = slow_server
    _probe(server, tally, cases[pick % len(cases)], tuple(hows), value)


# --- protocol 8.0.0: graphs by uid, the five new commands, random and mutated requests ----------
STALL8_S = 1.0                 # the 8.0.0 server's stall timeout: what a short payload or silent peer costs


@dataclasses.dataclass
class Counts8:
    """What the 8.0.0 tests sent, by kind (printed at the end; each must be non-zero)."""

    graphs: Tally = dataclasses.field(default_factory=Tally)
    kinds: Counter = dataclasses.field(default_factory=Counter)

    def __repr__(self) -> str:
        return f"Counts8({self.graphs.sent} graphs, {sum(self.kinds.values())} requests)"


@pytest.fixture(scope="module")
def server8(asan_lib_dir, tmp_path_factory, cases):
    """One `rknpu serve --protocol 8` on the ASan ggml for the 8.0.0 tests; at the end it must
    exit 0 with nothing reported."""
    s = AsanServer(asan_lib_dir, tmp_path_factory.mktemp("asan-serve8"), protocol=8, stall_timeout_s=STALL8_S)
    counts = Counts8()
    yield s, counts
    try:
        print(f"\nASan fuzz, 8.0.0: {counts.graphs.describe()}; requests {dict(counts.kinds)}")
        s.stop()
        assert not _reports(s.log_dir), _reports(s.log_dir)[:6000]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def _closed_with_reason(server: AsanServer, c: RpcClient, port: int, words: str, what: str) -> None:
    assert c.is_closed_by_server(timeout=STALL8_S + 5), f"{what}: the connection is still served"
    reason = server.reason(port)
    assert words in reason, f"{what}: expected a reason with {words!r}, got {reason!r}"


def _after(server: AsanServer, counts: Counts8, kind: str, what: str) -> None:
    counts.kinds[kind] += 1
    server.check(what)
    _good_graph(server)
    server.check(f"the good graph after {what}")


def test_protocol8_graphs_by_uid_are_refused_or_safe(server8, cases):
    """CI: every builder case as an 8.0.0 GRAPH_COMPUTE with a uid, under two mutations each
    (rotating, so every mutation is sent), and every computed one replayed by GRAPH_RECOMPUTE."""
    server, counts = server8
    for i, case in enumerate(cases):
        for how in (MUTATIONS[i % len(MUTATIONS)], MUTATIONS[(i + len(MUTATIONS) // 2) % len(MUTATIONS)]):
            _probe(server, counts.graphs, case, (how,), 1)
    assert counts.graphs.refused > 0 and counts.graphs.recomputed > 0
    assert set(counts.graphs.by_mutation) == set(MUTATIONS)


def _add_graph(c: RpcClient, n: int = 64):
    """a + b -> out, each in its own buffer of exactly its bytes; (a, b, out, b's buffer)."""
    (ha, pa), (hb, pb), (hc, pc) = (c.alloc_base(4 * n) for _ in range(3))
    a, b = T(ne=(n, 1, 1, 1), buffer=ha, data=pa), T(ne=(n, 1, 1, 1), buffer=hb, data=pb)
    out = T(ne=(n, 1, 1, 1), buffer=hc, data=pc, op=int(GgmlOp.ADD), src=(a.id, b.id))
    return a, b, out


def test_protocol8_uid_paths(server8):
    """Known and unknown uids, uid 0, a replay after FREE_BUFFER, a device that does not exist,
    and the clear at 1024 uids: replays compute exactly, the rest closes with a reason."""
    server, counts = server8
    x, y = np.arange(64, dtype=np.float32), np.full(64, 3.0, np.float32)

    def session(what: str, script) -> None:
        with server.client() as c:
            port = c.sock.getsockname()[1]
            a, b, out = _add_graph(c)
            c.set_array(a, x)
            c.set_array(b, y)
            script(c, port, a, b, out, what)
        _after(server, counts, "uid path", what)

    def known(c, port, a, b, out, what):
        c.graph_compute([out], [a, b, out], uid=3)
        c.set_array(a, 2 * x)
        c.graph_recompute(uid=3)                         # the replay reads the new values
        np.testing.assert_array_equal(c.get_array(out).ravel(), 2 * x + y)
        c.graph_compute([out], [a, b, out], uid=3)       # the same uid again: replaced, still exact
        c.graph_recompute(uid=3)
        np.testing.assert_array_equal(c.get_array(out).ravel(), 2 * x + y)

    def unknown(c, port, a, b, out, what):
        c.graph_compute([out], [a, b, out], uid=3)
        c.graph_recompute(uid=4)
        _closed_with_reason(server, c, port, "uid 4 not found", what)

    def uid0(c, port, a, b, out, what):
        c.graph_compute([out], [a, b, out], uid=0)       # uid 0: computed, never stored
        np.testing.assert_array_equal(c.get_array(out).ravel(), x + y)
        c.graph_recompute(uid=0)
        _closed_with_reason(server, c, port, "uid 0 not found", what)

    def after_free(c, port, a, b, out, what):
        c.graph_compute([out], [a, b, out], uid=8)
        spare, _ = c.alloc(64)
        c.free(spare)                                    # any FREE_BUFFER drops the stored graphs
        c.graph_recompute(uid=8)
        _closed_with_reason(server, c, port, "dropped when a buffer was freed", what)

    def other_device(c, port, a, b, out, what):
        c.graph_compute([out], [a, b, out], uid=9)
        c.graph_recompute(dev=1, uid=9)
        _closed_with_reason(server, c, port, "device 1 does not exist", what)

    def past_1024(c, port, a, b, out, what):
        for uid in range(1, 1025):                       # 1024 stored ...
            c.graph_compute([out], [a, b, out], uid=uid)
        c.graph_recompute(uid=1)
        assert c.device_count() == 1
        c.graph_compute([out], [a, b, out], uid=1025)    # ... the 1025th clears them, then is stored
        c.set_array(a, -x)
        c.graph_recompute(uid=1025)
        np.testing.assert_array_equal(c.get_array(out).ravel(), y - x)
        c.graph_recompute(uid=1)
        _closed_with_reason(server, c, port, "uid 1 not found", what)

    for name, script in (("known uid", known), ("unknown uid", unknown), ("uid 0", uid0),
                         ("after FREE_BUFFER", after_free), ("device 1", other_device), ("past 1024 uids", past_1024)):
        session(name, script)


def test_protocol8_tensor_2d(server8):
    """Seeded SET_TENSOR_2D / GET_TENSOR_2D rows around the edges of a tensor that fills its
    buffer exactly: the ones inside are written and read back exactly (against a numpy model of
    the buffer), the rest close with a reason."""
    server, counts = server8
    rng = np.random.default_rng(8)
    n_bytes = 256
    for i in range(40):                                  # rows that end near the tensor's end, both sides
        size, n_copies, stride = int(rng.integers(1, 48)), int(rng.integers(1, 5)), int(rng.integers(0, 64))
        offset = max(0, n_bytes - (n_copies - 1) * stride - size + int(rng.integers(-10, 10)))
        if i % 10 == 9:                                  # empty rows
            size, n_copies = (0, n_copies) if i % 20 == 9 else (size, 0)
        inside = (size > 0 and n_copies > 0 and offset <= n_bytes
                  and (n_copies - 1) * stride + size <= n_bytes - offset and size * n_copies <= n_bytes)
        kind = "GET_TENSOR_2D" if i % 2 else "SET_TENSOR_2D"
        what = f"{kind} offset {offset} size {size} n_copies {n_copies} stride {stride}"
        with server.client() as c:
            port = c.sock.getsockname()[1]
            h, base = c.alloc_base(n_bytes)
            t = T(ne=(n_bytes // 4, 1, 1, 1), buffer=h, data=base)
            model = rng.integers(0, 256, n_bytes, dtype=np.uint8)
            c.set_tensor(t, model.tobytes())
            starts = [offset + k * stride for k in range(n_copies)]
            if kind == "GET_TENSOR_2D" and inside:
                got = c.get_tensor_2d(t, offset, size, n_copies, stride)
                assert got == b"".join(model[s:s + size].tobytes() for s in starts), what
            elif kind == "GET_TENSOR_2D":
                c.send(Cmd.GET_TENSOR_2D, t.pack() + struct.pack("<QQQQ", offset, size, n_copies, stride))
                _closed_with_reason(server, c, port, "GET_TENSOR_2D", what)
            else:
                rows = rng.integers(0, 256, size * n_copies, dtype=np.uint8)
                c.set_tensor_2d(t, rows.tobytes(), offset, size, n_copies, stride)
                if inside:
                    for k, s in enumerate(starts):       # later rows win where rows overlap
                        model[s:s + size] = rows[k * size:(k + 1) * size]
                    assert c.get_tensor(t) == model.tobytes(), what
                else:
                    _closed_with_reason(server, c, port, "SET_TENSOR_2D", what)
        _after(server, counts, kind + (" inside" if inside else " outside"), what)
    assert {"SET_TENSOR_2D inside", "SET_TENSOR_2D outside", "GET_TENSOR_2D inside",
            "GET_TENSOR_2D outside"} <= set(counts.kinds)


class Rank0Peer:
    """A well-behaved rank 0 on the server-to-server link (the server under test is rank 1):
    caps, then per all-reduce it sends ``mine`` once ``go`` is set and keeps what it received."""

    def __init__(self, port: int, mine: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(10)
        self.mine, self.received = mine, b""
        self.go, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            sock, _ = self.listener.accept()
            with sock:
                sock.settimeout(10)
                _recv_all(sock, comm.CAPS_SIZE)
                sock.sendall(bytes(comm.CAPS_SIZE))
                if self.go.wait(10):
                    sock.sendall(self.mine)
                    self.received = _recv_all(sock, len(self.mine))
                self.release.wait(10)
        except OSError:
            pass                                         # the server dropped the link: judged on its side
        finally:
            self.listener.close()

    def end(self) -> None:
        self.go.set()
        self.release.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def _recv_all(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n and (chunk := sock.recv(n - len(out))):
        out += chunk
    return bytes(out)


def test_protocol8_comm(server8):
    """COMM_INIT that cannot pair is answered 0 at once and the session goes on; COMM_ALLREDUCE
    without a link, or of a tensor that is not contiguous F32 inside its buffer, closes with a
    reason; with a well-behaved peer the sum is exact (raw and BF16); COMM_FREE without a link
    is a no-op."""
    server, counts = server8
    for rank, world, port, host in ((0, 3, 5000, ""), (2, 2, 5000, ""), (0, 2, 0, ""), (0, 2, 70000, ""),
                                    (1, 2, 5000, "a" * 64)):
        what = f"COMM_INIT rank {rank} world {world} port {port} host {host[:8]!r}"
        with server.client() as c:
            t0 = time.monotonic()
            assert c.comm_init(rank=rank, world=world, port=port, host=host) == 0, what
            assert time.monotonic() - t0 < STALL8_S, f"{what}: answered after a wait"
            c.send(Cmd.COMM_FREE, struct.pack("<I", 0))
            assert c.device_count() == 1, what
        _after(server, counts, "COMM_INIT refused", what)
    with server.client() as c:
        port = c.sock.getsockname()[1]
        a, _, _ = _add_graph(c)
        c.send(Cmd.COMM_ALLREDUCE, struct.pack("<I", 0) + a.pack())
        _closed_with_reason(server, c, port, "without a communicator", "COMM_ALLREDUCE without COMM_INIT")
    _after(server, counts, "COMM_ALLREDUCE refused", "COMM_ALLREDUCE without COMM_INIT")

    def bad_tensor(t: T, how: str) -> T:
        if how == "f16":
            return dataclasses.replace(t, type=int(GgmlType.F16), nb=None, id=t.id + 1)
        if how == "strided":
            return dataclasses.replace(t, ne=(t.ne[0] // 2, 2, 1, 1), nb=(4, t.ne[0] * 2, t.ne[0] * 4, t.ne[0] * 4))
        if how == "past its buffer":
            return dataclasses.replace(t, data=t.data + 4)
        return dataclasses.replace(t, buffer=t.buffer ^ 0x5A5A0000)   # "unknown buffer"

    for n, how in ((300, None), (comm.BF16_FROM_ELEMENTS, None), (300, "f16"), (300, "strided"),
                   (300, "past its buffer"), (300, "unknown buffer")):
        what = f"COMM_ALLREDUCE of {n} elements" + (f", {how}" if how else "")
        rng = np.random.default_rng(n)
        mine, theirs = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        link_port = free_port()
        peer = Rank0Peer(link_port, (comm.fp32_to_bf16(theirs) if n >= comm.BF16_FROM_ELEMENTS else theirs).tobytes())
        try:
            with server.client() as c:
                port = c.sock.getsockname()[1]
                h, base = c.alloc_base(4 * n)
                t = T(ne=(n, 1, 1, 1), buffer=h, data=base)
                c.set_array(t, mine)
                assert c.comm_init(rank=1, world=2, port=link_port, host="127.0.0.1") == 1, what
                c.send(Cmd.COMM_ALLREDUCE, struct.pack("<I", 0) + (bad_tensor(t, how) if how else t).pack())
                if how:
                    _closed_with_reason(server, c, port, "COMM_ALLREDUCE", what)
                else:
                    peer.go.set()
                    got = np.frombuffer(c.get_tensor(t), np.float32)
                    c.send(Cmd.COMM_FREE, struct.pack("<I", 0))
                    assert c.device_count() == 1
        finally:
            peer.end()
        if not how:
            peer_values = comm.bf16_to_fp32(comm.fp32_to_bf16(theirs)) if n >= comm.BF16_FROM_ELEMENTS else theirs
            np.testing.assert_array_equal(got, mine + peer_values, err_msg=what)
            sent = comm.fp32_to_bf16(mine) if n >= comm.BF16_FROM_ELEMENTS else mine
            assert peer.received == sent.tobytes(), f"{what}: the server sent other bytes"
        _after(server, counts, "COMM_ALLREDUCE " + ("refused" if how else "summed"), what)


def _valid_protocol8_requests(c: RpcClient) -> dict[str, bytes]:
    """One valid request of every command 8.0.0 adds or changes (COMM_INIT: one answered 0 at
    once, port 0), each tensor in its own buffer of exactly its bytes."""
    a, b, out = _add_graph(c, 32)
    rows = struct.pack("<QQQQ", 16, 8, 3, 32)                    # offset, size, n_copies, stride
    return {
        "graph": wire.pack_request(Cmd.GRAPH_COMPUTE, graph_payload([out], [a, b, out], uid=11)),
        "recompute": wire.pack_request(Cmd.GRAPH_RECOMPUTE, struct.pack("<IQ", 0, 11)),
        "set_2d": wire.pack_request(Cmd.SET_TENSOR_2D, a.pack() + rows + bytes(24)),
        "get_2d": wire.pack_request(Cmd.GET_TENSOR_2D, a.pack() + rows),
        "comm_init": wire.pack_request(Cmd.COMM_INIT, struct.pack("<IIII64s", 0, 0, 2, 0, b"")),
        "allreduce": wire.pack_request(Cmd.COMM_ALLREDUCE, struct.pack("<I", 0) + out.pack()),
        "comm_free": wire.pack_request(Cmd.COMM_FREE, struct.pack("<I", 0)),
    }


PROTOCOL8_COMMANDS = (Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE, Cmd.SET_TENSOR_2D, Cmd.GET_TENSOR_2D, Cmd.COMM_INIT,
                      Cmd.COMM_ALLREDUCE, Cmd.COMM_FREE)
_RANDOM8 = {"cmd": st.one_of(st.sampled_from(PROTOCOL8_COMMANDS), st.integers(0, 30)),
            "size": st.integers(0, 800), "data": st.binary(max_size=800)}
_MUTATED8 = {"which": st.sampled_from(["graph", "recompute", "set_2d", "get_2d", "comm_init", "allreduce",
                                       "comm_free"]),
             "flips": st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
             "resize": st.sampled_from([0, 0, 0, -1, 1])}


def _random8(server: AsanServer, counts: Counts8, cmd: int, size: int, data: bytes) -> None:
    """A random header and payload after HELLO, then DEVICE_COUNT; the server answers in order
    or closes, and then computes a good graph."""
    with server.client() as c:
        c.sock.sendall(struct.pack("<BQ", cmd, size) + data[:size] + wire.pack_request(Cmd.DEVICE_COUNT))
        _drain(c)
    _after(server, counts, "random", f"random request cmd {cmd} size {size}")


def _mutated8(server: AsanServer, counts: Counts8, which: str, flips: list[tuple[int, int]], resize: int) -> None:
    """A valid uid graph, then one mutated 8.0.0 request, then DEVICE_COUNT."""
    with server.client() as c:
        reqs = _valid_protocol8_requests(c)
        c.sock.sendall(reqs["graph"])
        req = bytearray(reqs[which])
        for pos, value in flips:
            req[9 + pos % (len(req) - 9)] = value
        if resize:                                       # a size field that disagrees with the payload
            struct.pack_into("<Q", req, 1, max(0, len(req) - 9 + resize))
        c.sock.sendall(bytes(req) + wire.pack_request(Cmd.DEVICE_COUNT))
        _drain(c)
    _after(server, counts, f"mutated {which}", f"mutated {which} {flips} resize {resize}")


def _drain(c: RpcClient) -> None:
    """Replies until DEVICE_COUNT's, or the close; at most the stall timeout and a margin."""
    c.sock.settimeout(STALL8_S + 5)
    try:
        while c.reply() != struct.pack("<I", 1):
            pass
    except (ServerClosed, ConnectionResetError, BrokenPipeError, TimeoutError, AssertionError):
        pass


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_RANDOM8)
def test_protocol8_random_requests(server8, cmd, size, data):
    server, counts = server8
    _random8(server, counts, cmd, size, data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_MUTATED8)
def test_protocol8_mutated_requests(server8, which, flips, resize):
    server, counts = server8
    _mutated8(server, counts, which, flips, resize)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_protocol8_every_mutation_with_values_slow(server8, cases):
    """Every case under every mutation with 8 values, as 8.0.0 graphs by uid, each computed one
    replayed."""
    server, counts = server8
    for case in cases:
        for how in MUTATIONS:
            for value in range(8):
                _probe(server, counts.graphs, case, (how,), value)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_RANDOM8)
def test_protocol8_random_requests_slow(server8, cmd, size, data):
    server, counts = server8
    _random8(server, counts, cmd, size, data)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_MUTATED8)
def test_protocol8_mutated_requests_slow(server8, which, flips, resize):
    server, counts = server8
    _mutated8(server, counts, which, flips, resize)
