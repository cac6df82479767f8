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

The CI test sends every case once per mutation (about 500 graphs, ~15 s here); the slow ones
sweep 32 values per mutation and chain up to three random mutations per graph.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
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

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.ops.rules import RULES
from ggml_rknpu.toolchain import llamacpp
from support.malformed import BAD, MUTATIONS, Case, builder_cases, mutate, send, still_talking
from support.rpc_testkit import RpcClient, ServerClosed, T, wait_for_line

pytestmark = pytest.mark.timeout(600)
# ops the sweep must reach: every index-reading op, and the families of tests/server/ops (a floor, so a
# rule added without a builder case does not silently shrink the sweep)
MUST_COVER = frozenset({GgmlOp.GET_ROWS, GgmlOp.SET_ROWS, GgmlOp.MUL_MAT_ID, GgmlOp.ADD_ID, GgmlOp.SSM_SCAN,
                        GgmlOp.MUL_MAT, GgmlOp.ROPE, GgmlOp.SOFT_MAX, GgmlOp.FLASH_ATTN_EXT, GgmlOp.CPY,
                        GgmlOp.GLU, GgmlOp.UNARY, GgmlOp.RMS_NORM, GgmlOp.CONCAT, GgmlOp.IM2COL,
                        GgmlOp.GATED_DELTA_NET, GgmlOp.RWKV_WKV7, GgmlOp.ARGSORT, GgmlOp.TOP_K})


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

    def __init__(self, lib_dir: Path, tmp: Path) -> None:
        self.log_dir, self.stats_json = tmp / "asan-logs", tmp / "stats.json"
        self.log_dir.mkdir()
        env = _asan_env(lib_dir, self.log_dir)
        self.proc = subprocess.Popen([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0",
                                      "--device", "host", "-t", "1", "--stall-timeout", "5",
                                      "--stats-json", str(self.stats_json)],
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
        return RpcClient(self.port)

    def check(self, what: str) -> None:
        """The server is alive and ASan has said nothing (else: fail naming the graph)."""
        if self.proc.poll() is not None or any(self.log_dir.iterdir()):
            time.sleep(0.5)
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
    """ADD of two known vectors computes exactly (each tensor in its own buffer)."""
    a = np.arange(256, dtype=np.float32)
    b = np.full(256, 0.5, dtype=np.float32)
    with server.client() as c:
        (ha, pa), (hb, pb), (hc, pc) = (c.alloc_base(1024) for _ in range(3))
        ta, tb = T(ne=(256, 1, 1, 1), buffer=ha, data=pa), T(ne=(256, 1, 1, 1), buffer=hb, data=pb)
        tc = T(ne=(256, 1, 1, 1), buffer=hc, data=pc, op=int(GgmlOp.ADD), src=(ta.id, tb.id))
        c.set_array(ta, a)
        c.set_array(tb, b)
        c.graph_compute([tc], [ta, tb, tc])
        np.testing.assert_array_equal(c.get_array(tc).ravel(), a + b)


@dataclasses.dataclass
class Tally:
    sent: int = 0
    refused: int = 0
    computed: int = 0                                   # graphs a MAYBE mutation left valid
    ops: set = dataclasses.field(default_factory=set)
    by_mutation: Counter = dataclasses.field(default_factory=Counter)

    def __repr__(self) -> str:                          # hypothesis prints the fixture on a failure
        return f"Tally({self.sent} sent)"

    def describe(self) -> str:
        covered = len(self.ops & set(RULES))
        return (f"{self.sent} graphs sent, {self.refused} refused with a logged reason, {self.computed} computed "
                f"(still valid), ops {covered}/{len(RULES)} admitted ops; per mutation {dict(self.by_mutation)}")


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
            send(c, node, srcs, case.index, bad_index, separate=True)
            computed = still_talking(c)
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
