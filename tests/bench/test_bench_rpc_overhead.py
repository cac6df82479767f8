"""The RPC-overhead benchmark's arithmetic on server counters (the run itself is a benchmark, not a test)."""

from __future__ import annotations

import pytest

from ggml_rknpu.bench.rpc_overhead import decode_overhead


def test_per_node_figure_excludes_matmul_time() -> None:
    stats = {"execute_seconds": 1.0, "graph_runs": 5, "recomputes": 4, "host_seconds": 0.3, "host_segments": 40,
             "per_op": [
        {"op": "MUL_MAT", "engine": "npu", "nodes": 100, "host_seconds": 0.6},
        {"op": "MUL_MAT", "engine": "host", "nodes": 20, "host_seconds": 0.0},
        {"op": "ADD", "engine": "host", "nodes": 150, "host_seconds": 0.0},
        {"op": "ROPE", "engine": "host", "nodes": 50, "host_seconds": 0.0},
    ]}
    got = decode_overhead(stats)
    assert got["nodes_excl_matmul"] == 200 and got["matmul_nodes"] == 120 and got["host_nodes"] == 220
    assert got["host_us_per_node_excl_matmul_measured"] == pytest.approx((1.0 - 0.6) / 200 * 1e6)
    assert got["ggml_us_per_host_node_measured"] == pytest.approx(0.3 / 220 * 1e6)
    assert got["recomputes"] == 4
    # the split: inside ggml-cpu and the replay's own bookkeeping, which add up to the whole
    assert got["ggml_us_per_node_excl_matmul_measured"] == pytest.approx(0.3 / 200 * 1e6)
    assert got["bookkeeping_us_per_node_excl_matmul_measured"] == pytest.approx((1.0 - 0.6 - 0.3) / 200 * 1e6)
    assert got["host_segments_per_graph"] == 8


def test_nothing_offloaded_is_an_error() -> None:
    with pytest.raises(ValueError, match="offloaded"):
        decode_overhead({"execute_seconds": 0.0, "per_op": [{"op": "MUL_MAT", "engine": "npu", "nodes": 3,
                                                              "host_seconds": 0.1}]})
