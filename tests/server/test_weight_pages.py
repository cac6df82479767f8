"""Weight pages and board accounting (server/weight_pages.py, server/board_memory.py): the GGUF
bytes of a repacked or NPU-staged weight move to a file the kernel may drop; GET_TENSOR, the
repacked kernel and re-staging after a fault read them back exactly, also after the kernel
paged them out; the board accounting follows the server's anonymous memory (measured)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from ggml_rknpu.bench.memory import anon_bytes, stats_now
from ggml_rknpu.kernel.errors import NpuFault
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.rpc import report
from ggml_rknpu.server.weight_pages import PAGE, BufferPages, WeightPages, anonymous_buffer, filesystem_type
from ggml_rknpu.toolchain import launch
from support.matmul_graph import M, MatmulGraph, fp16_ref, rng_w
from support.rpc_testkit import FaultyNpu, RpcClient, T, serve

pytestmark = pytest.mark.timeout(120)
MUL_MAT, Q4_0 = int(GgmlOp.MUL_MAT), int(GgmlType.Q4_0)
K = 256
Q4_ROW = K // 32 * 18
MADV_PAGEOUT = 21          # Linux 5.4+ (mman-common.h): reclaim these pages now
MIB = 2**20
# Board accounting vs the server's anonymous memory (its own process), after a first client:
# what is left is the allocator's slack.
TOLERANCE = (0.02, 2 * MIB)     # relative, absolute (measured here: within 0.7 MiB of 34 and 66 MiB)


def q4_0_rows(n: int, seed: int = 0) -> bytes:
    """n rows of Q4_0 (K = 256): 256 quantized rows tiled (quantizing millions of values in numpy
    would dominate the test)."""
    rows = quants.quantize(np.random.default_rng(seed).standard_normal((256, K)).astype(np.float32),
                           GGMLQuantizationType.Q4_0).tobytes()
    return rows * (n // 256)


def store_mappings(directory: Path) -> list[tuple[int, int, int]]:
    """(start, end, Rss bytes) of this process's mappings of files in ``directory`` (/proc/self/smaps)."""
    out: list[tuple[int, int, int]] = []
    current: list[int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            current = None
            if len(head) >= 6 and head[5].startswith(str(directory)):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = [lo, hi, 0]
                out.append(current)  # type: ignore[arg-type]
        elif current is not None and head[0] == "Rss:":
            current[2] = int(head[1]) * 1024
    return [tuple(m) for m in out]  # type: ignore[misc]


def page_out(directory: Path) -> None:
    """Write the store's dirty pages back and ask the kernel to reclaim them (MADV_PAGEOUT)."""
    os.sync()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for lo, hi, _ in store_mappings(directory):
        if libc.madvise(lo, hi - lo, MADV_PAGEOUT) != 0:
            pytest.skip(f"this kernel refuses MADV_PAGEOUT ({os.strerror(ctypes.get_errno())})")


def resident(directory: Path) -> int:
    return sum(rss for _, _, rss in store_mappings(directory))


@pytest.fixture
def pages(tmp_path: Path) -> WeightPages:
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"the test's temporary directory {tmp_path} is on tmpfs: its pages cannot be dropped")
    return WeightPages(tmp_path / "pages")


def test_tmpfs_is_refused(tmp_path: Path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"1 0 8:1 / / rw - ext4 /dev/vda rw\n2 1 0:5 / {tmp_path} rw - tmpfs tmpfs rw\n")
    assert filesystem_type(tmp_path / "x", mountinfo) == "tmpfs"
    assert filesystem_type(Path("/usr"), mountinfo) == "ext4"


def test_pages_keep_the_bytes_and_a_failing_store_leaves_them_anonymous(pages: WeightPages, caplog):
    size = 16 * PAGE
    buf = np.frombuffer(anonymous_buffer(size), dtype=np.uint8)
    buf[:] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    before = buf.copy()
    kept = BufferPages(pages, buf.ctypes.data, size)
    assert kept.keep(100, 8 * PAGE + 5) == 7 * PAGE                 # the whole pages inside only
    assert kept.keep(PAGE, 2 * PAGE) == 0                            # moved already
    buf[PAGE + 7] ^= 0xFF                                            # a write reaches the file
    before[PAGE + 7] ^= 0xFF
    np.testing.assert_array_equal(buf, before)
    assert pages.bytes == 7 * PAGE
    kept.close()
    assert pages.bytes == 0
    pages.directory.rmdir()                                          # the store is gone
    failing = BufferPages(pages, buf.ctypes.data, size)
    assert failing.keep(9 * PAGE, 12 * PAGE) == 0 and failing.failed and pages.bytes == 0
    assert failing.keep(12 * PAGE, 14 * PAGE) == 0
    np.testing.assert_array_equal(buf, before)
    assert [r.getMessage().startswith("weight pages: the buffer's weights stay in anonymous memory")
            for r in caplog.records] == [True]


def _repacked_run(n: int, **serve_kw) -> tuple[np.ndarray, np.ndarray, bytes, dict, list[bytes]]:
    """A host Q4_0 matmul [n, K] from its repacked copy: (out, out again after the pages went, the
    bytes read back, the stats, the bytes read back after the pages went)."""
    wq = q4_0_rows(n)
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    with serve(placement="host", host_repack=True, **serve_kw) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(len(wq))
            ch, cb = c.alloc_base(1 << 20)
            w = T(ne=(K, n, 1, 1), buffer=wh, data=wb, type=Q4_0, name="blk.0.ffn_up.weight")
            xt = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
            out = T(ne=(n, M, 1, 1), buffer=ch, data=cb + 4096, op=MUL_MAT, src=(w.id, xt.id), name="out")
            c.set_tensor(w, wq)
            c.set_array(xt, x)
            c.graph_compute([out], [w, xt, out])
            first = c.get_array(out)
            back = c.get_tensor(w)
            stats = report.stats_dict(st.state)
            store = serve_kw.get("pages")
            if store is not None:
                page_out(store.directory)
                assert resident(store.directory) < PAGE * 4      # the kernel dropped them
            again = [c.get_tensor(w)]
            c.graph_recompute()
            second = c.get_array(out)
        assert back == wq
        return first, second, back, stats, again


def test_repacked_weight_bytes_are_paged_and_read_back_exactly(pages: WeightPages):
    n = 8192                                    # 1.1 MiB of Q4_0
    plain = _repacked_run(n)
    paged = _repacked_run(n, pages=pages)
    np.testing.assert_array_equal(paged[0], plain[0])      # ggml's repacked kernel, bit for bit
    np.testing.assert_array_equal(paged[1], plain[0])
    assert paged[4] == [paged[2]]                           # GET_TENSOR after the kernel dropped the pages
    board, before = paged[3]["board_memory"], plain[3]["board_memory"]
    nbytes = n * Q4_ROW
    assert board["weight_pages"] == nbytes // PAGE * PAGE and before["weight_pages"] == 0
    assert board["repacked_host_copies"] == before["repacked_host_copies"] == nbytes
    assert board["client_buffers"] == before["client_buffers"] - board["weight_pages"]
    assert pages.bytes == 0                                 # the session freed its buffers


def test_restaging_after_a_fault_reads_dropped_pages_exactly(pages: WeightPages):
    npu = FaultyNpu(reset_loses_weights=True)
    w = rng_w()
    x = np.random.default_rng(2).standard_normal((M, w.shape[1])).astype(np.float32)
    with serve(npu=npu, pages=pages) as st:
        with st.client() as c:
            g = MatmulGraph(c)
            c.set_array(g.w, w)
            c.set_array(g.x, x)
            np.testing.assert_allclose(g.compute(), fp16_ref(x, w), rtol=1e-5, atol=1e-5)
            assert report.stats_dict(st.state)["board_memory"]["weight_pages"] == w.nbytes // PAGE * PAGE
            page_out(pages.directory)
            npu.faults.append(NpuFault("dma", 14))
            c.graph_recompute()
            np.testing.assert_allclose(c.get_array(g.out), fp16_ref(x, w), rtol=1e-5, atol=1e-5)
            assert c.get_tensor(g.w) == w.tobytes()
        assert st.state.recovery.resets == 1 and st.state.weight_stats.uploads == 2   # staged again


def _repacked_client(port: int, n: int, wq: bytes, x: np.ndarray, connected=None) -> None:
    """A client's host Q4_0 matmul [n, K] from a repacked copy, its compute buffer committed
    whole; ``connected()`` runs while it is still connected."""
    with RpcClient(port) as c:
        wh, wb = c.alloc_base(len(wq))
        ch, cb = c.alloc_base(n * M * 4 + 4096)
        w = T(ne=(K, n, 1, 1), buffer=wh, data=wb, type=Q4_0, name="blk.0.ffn_up.weight")
        xt = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
        out = T(ne=(n, M, 1, 1), buffer=ch, data=cb + 4096, op=MUL_MAT, src=(w.id, xt.id), name="out")
        c.set_tensor(w, wq)
        c.clear(ch, 0)
        c.set_array(xt, x)
        c.graph_compute([out], [w, xt, out])
        assert c.get_array(out).shape == (M, n)
        if connected is not None:
            connected()


@pytest.mark.parametrize("paged", [False, True], ids=["anonymous", "weight-pages"])
def test_board_accounting_follows_the_servers_anonymous_memory(paged: bool, tmp_path: Path):
    """``rknpu serve --device host``: the growth of the accounting's total is the growth of the
    server's anonymous memory, within TOLERANCE, with and without weight pages."""
    n = 4096 * 56                            # 31.5 MiB of Q4_0, its repacked copy as much again
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    stats = tmp_path / "stats.json"
    port = launch.free_port()
    pages = ("--weight-pages", str(tmp_path / "pages")) if paged else ("--no-weight-pages",)
    with open(tmp_path / "serve.log", "w") as log:
        server = launch.start_rknpu_serve(port, device="host", log=log, extra=(
            "-t", "1", "--placement", "host", "--stats-json", str(stats), *pages))
        try:
            _repacked_client(port, 256, q4_0_rows(256), x)       # the first plan's imports and pools
            readings = []

            def read() -> None:
                readings.append((stats_now(server.pid, stats)["board_memory"], anon_bytes(server.pid)))

            read()
            _repacked_client(port, n, q4_0_rows(n), x, connected=read)
        finally:
            launch.stop(server)
    (before, base_anon), (board, anon) = readings
    grew, counted = anon - base_anon, board["total"] - before["total"]
    print(f"\nmeasured here: board accounting +{counted / MIB:.1f} MiB, RssAnon +{grew / MIB:.1f} MiB ({board})")
    assert abs(grew - counted) <= TOLERANCE[0] * counted + TOLERANCE[1]
    assert board["weight_pages"] == (n * Q4_ROW // PAGE * PAGE if paged else 0)
    assert board["repacked_host_copies"] == n * Q4_ROW
