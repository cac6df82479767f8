"""``rknpu serve --engine rknn`` and ``rknpu bench matmul --engines ours,rknn`` through the gcc-built
librknnrt stand-in (no board here): the device rule of ``rknn.opener``, the clear error when the
library is missing, a MUL_MAT served with its weight staged in librknnrt contexts, and bench rows
for both engines, the stand-in's labelled as such."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.rknn import binding as rb
from ggml_rknpu.rknn import opener
from support.bench_support import RIGS, valid_png
from support.bench_support import run_bench_cli as run_cli
from support.rknn_support import standin_path  # noqa: F401  (fixture)
from support.rpc_testkit import RpcClient, T, wait_for_line

pytestmark = pytest.mark.timeout(120)
K, N, M = 64, 32, 3


def _serve(env: dict, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0", "--no-progress",
                             *argv], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **env})




def f32(buffer, data, *ne, **kw) -> T:
    return T(ne=tuple(ne) + (1,) * (4 - len(ne)), buffer=buffer, data=data, **kw)


# --- the device rule ----------------------------------------------------------------------------
def test_standin_is_recognised_by_its_marker(standin_path):
    assert rb.RknnLibrary(standin_path).is_standin


def test_rule_explicit_path_without_board(monkeypatch, standin_path):
    monkeypatch.setattr(opener, "vendor_node", lambda: None)
    monkeypatch.setenv("LIBRKNNRT_PATH", str(standin_path))
    npu, setup = opener.open_rknn("auto", max_contexts=3, cores=3)
    try:
        assert setup.standin and not setup.on_board and setup.library == standin_path
        assert npu.max_contexts == 3 and npu.core_mask == rb.CORE_MASKS["core0_1_2"]
        assert "STAND-IN" in setup.describe()
    finally:
        npu.close()
    with pytest.raises(opener.RknnRefused, match="vendor rknpu driver"):
        opener.load("sim-rknpu")
    with pytest.raises(opener.RknnRefused, match="--device host"):
        opener.load("host")


def test_rule_library_in_usual_dirs_needs_a_board(monkeypatch, standin_path):
    monkeypatch.delenv("LIBRKNNRT_PATH", raising=False)
    monkeypatch.setattr(rb, "SEARCH_DIRS", (str(standin_path.parent),))
    monkeypatch.setattr(opener, "vendor_node", lambda: None)
    with pytest.raises(opener.RknnRefused, match="no /dev/dri/renderD.*LIBRKNNRT_PATH"):
        opener.load("auto")
    monkeypatch.setattr(opener, "vendor_node", lambda: "/dev/dri/renderD129")
    _lib, setup = opener.load("rknpu")
    assert setup.board_node == "/dev/dri/renderD129" and setup.standin and not setup.on_board


def test_probe_failure_is_reported_at_load(monkeypatch, standin_path):
    """A runtime that cannot create a context fails at start-up with its own code."""
    monkeypatch.setenv("LIBRKNNRT_PATH", str(standin_path))
    monkeypatch.setattr(opener, "vendor_node", lambda: None)

    def refuse(lib):
        raise rb.RknnError("rknn_matmul_create", -3)
    monkeypatch.setattr(opener, "probe", refuse)
    with pytest.raises(rb.RknnError, match=r"-3 \(device is unavailable\)"):
        opener.load("auto")


# --- rknpu serve --engine rknn ----------------------------------------------------------------------
def test_serve_engine_rknn_missing_library_is_a_clear_error(tmp_path):
    proc = _serve({"LIBRKNNRT_PATH": str(tmp_path / "librknnrt.so")}, "--engine", "rknn")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "cannot open the rknn engine" in err and "librknnrt.so not found" in err
    assert "LIBRKNNRT_PATH" in err and "rknn-toolkit2" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, match", [
    (("--engine", "rknn", "--device", "host"), "contradict"),
    (("--engine", "rknn", "--device", "sim-rknpu"), "cannot run the rknn engine"),
    (("--engine", "rknn", "--rknn-contexts", "0"), "at least 1"),
])
def test_serve_engine_rknn_refusals(standin_path, argv, match):
    proc = _serve({"LIBRKNNRT_PATH": str(standin_path)}, *argv)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and match in err, err


def test_serve_engine_rknn_runs_a_matmul_through_the_standin(standin_path, tmp_path):
    stats_file = tmp_path / "stats.json"
    proc = _serve({"LIBRKNNRT_PATH": str(standin_path)}, "--engine", "rknn", "--rknn-contexts", "4",
                  "--stats-json", str(stats_file))
    lines: list[str] = []
    rng = np.random.default_rng(3)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    try:
        m = wait_for_line(proc, r"on 127\.0\.0\.1:(\d+), (.*?), weights", lines)
        port = int(m.group(1))
        assert "rknn engine through the TEST STAND-IN" in m.group(2) and "at most 4 contexts" in m.group(2)
        with RpcClient(port) as c:
            wh, wb = c.alloc_base(1 << 16)
            ch, cb = c.alloc_base(1 << 16)
            wt = T(ne=(K, N, 1, 1), buffer=wh, data=wb, name="blk.0.ffn_up.weight")
            xt = f32(ch, cb, K, M, name="x")
            out = f32(ch, cb + 4096, N, M, op=int(GgmlOp.MUL_MAT), src=(wt.id, xt.id), name="out")
            c.set_array(wt, w)
            for scale in (1.0, 2.0):
                c.set_array(xt, scale * x)
                c.graph_compute([out], [wt, xt, out])
                got = c.get_array(out)
                a16 = (scale * x).astype(np.float16).astype(np.float64)
                b16 = w.astype(np.float16).astype(np.float64)
                bound = 1.01 * (K + 1) * 2.0**-24 * (np.abs(a16) @ np.abs(b16).T)   # test_engine_matmul.py
                assert got.shape == (M, N) and (np.abs(got - a16 @ b16.T) <= bound).all()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None
        rest = proc.stderr.read()
        found = re.search(r"rknn engine counters: (\{.*\})", rest)
        assert found is not None, rest
        counters = json.loads(found.group(1).replace("'", '"'))
        assert counters["weights_uploaded"] == 1 and counters["contexts_created"] == 1
        assert counters["matmuls"] == 2 and counters["context_cache_hits"] == 1
        assert counters["b_bytes_staged"] == N * K * 2                      # fp16 B staged once
        stats = json.loads(stats_file.read_text())
        assert {"op": "MUL_MAT", "engine": "npu"} in [{k: r[k] for k in ("op", "engine")} for r in stats["per_op"]]
        assert stats["npu_device_label"] == "modeled"
    finally:
        proc.kill()
        proc.wait()


# --- rknpu bench matmul --engines ours,rknn -----------------------------------------------------------
@pytest.mark.timeout(300)
def test_bench_matmul_rows_for_both_engines(monkeypatch, standin_path, tmp_path):
    monkeypatch.setenv("LIBRKNNRT_PATH", str(standin_path))
    out = tmp_path / "bench"
    assert run_cli("matmul", "--engines", "ours,rknn", "--device", "sim-rknpu", "--shapes", "small", "--ms", "1,16",
                   "--dtypes", "fp16,int8", "--cores", "1", "--iters", "2", "--warmup", "0",
                   "--max-sim-macs", str(16 * 256 * 128 - 1), "--out", str(out),
                   "--rig-root", str(RIGS / "not_rk3588")) == 0
    data = json.loads((out / "matmul.json").read_text())
    rows = data["raw"]["rows"]
    assert [r["engine"] for r in rows] == ["ours"] * 8 + ["rknn"] * 8
    ours, rknn = rows[:8], rows[8:]
    assert [(r["shape"], r["dtype"], r["M"]) for r in ours] == [(r["shape"], r["dtype"], r["M"]) for r in rknn]
    assert {r["ran_on"] for r in ours if r["executed"]} == {"simulator"}
    assert {r["ran_on"] for r in rknn if r["executed"]} == {"stand-in"}
    assert {(r["engine"], r["shape"], r["M"]) for r in rows if not r["executed"]} == {
        (e, "small 256x128", 16) for e in ("ours", "rknn")}
    for r in rows:
        assert r["gflops_modeled"] > 0 and "gflops_measured" not in r and "gflops_call_measured" not in r
    for r in (r for r in rknn if r["executed"]):
        assert r["calls"] == 2 and r["submit_ms_measured"] > 0
        # the engine's own modeled device time (librknnrt profile, padded N) beside our program's
        assert r["device_ms_modeled"] > 0
    # different cost profiles: the librknnrt submit cost (250 µs) exceeds ours (79 µs) [docs/engine.md]
    small = {(r["engine"], r["dtype"]): r["device_ms_modeled"] for r in rows if r["shape"] == "small 64x64" and r["M"] == 1}
    assert small[("rknn", "fp16")] > small[("ours", "fp16")]
    assert data["meta"]["engines"] == ["ours", "rknn"]
    assert data["meta"]["rknn"]["standin"] is True and data["meta"]["rknn"]["on_board"] is False
    assert data["meta"]["simulated"] is True
    md = (out / "matmul.md").read_text()
    assert "| engine |" in md and "| rknn |" in md and "| stand-in |" in md and "TEST STAND-IN" in md
    assert "device ms (modeled)" in md and "submit ms (measured)" in md
    assert len(data["plots"]) == 2
    for p in data["plots"]:
        labels = {s["label"] for s in p["series"]}
        assert labels == {f"{e} {d} 1c (modeled)" for e in ("ours", "rknn") for d in ("fp16", "int8")}
        valid_png(out / p["file"])


def test_bench_matmul_rknn_missing_library_fails_clearly(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LIBRKNNRT_PATH", str(tmp_path / "absent" / "librknnrt.so"))
    out = tmp_path / "bench"
    assert run_cli("matmul", "--engines", "rknn", "--shapes", "small", "--out", str(out),
                   "--rig-root", str(RIGS / "not_rk3588")) == 1
    text = capsys.readouterr().out
    assert "cannot open the rknn engine" in text and "LIBRKNNRT_PATH" in text
    assert not out.exists()


def test_rknn_rows_on_a_board_plot_wall_time_as_the_measured_figure():
    """librknnrt gives no device clock: device time stays modeled, the call's wall time is the
    measured figure, and the plot names it end-to-end."""
    from ggml_rknpu.bench import matmul as mm
    from ggml_rknpu.cli.bench import _gflops_plots
    from ggml_rknpu.engine.timing import Timing

    rows = []
    for engine in ("ours", "rknn"):
        case = mm.Case(mm.SEED_SHAPES[0], 1, "fp16", 3, engine)
        label = "measured" if engine == "ours" else "modeled"
        calls = [(2e-3, mm.read_timing(Timing(1e-4, 1.2e-3, 2e-5, 1e-3, label, 1)))] * 3
        rows.append(mm.summarize_calls(case, calls, on_board=True))
    ours, rknn = rows
    assert rknn["engine"] == "rknn" and rknn["ran_on"] == "board"
    assert rknn["device_ms_modeled"] == pytest.approx(1.0) and "device_ms_measured" not in rknn
    assert rknn["gflops_call_measured"] == pytest.approx(ours["gflops_call_measured"])
    assert "device_ms_measured" in ours
    (plot,) = _gflops_plots(rows, engines=True)
    assert {s.label for s in plot.series} == {"ours fp16 3c (measured)", "ours fp16 3c (modeled)",
                                              "rknn fp16 3c (modeled)", "rknn fp16 3c end-to-end (measured)"}
