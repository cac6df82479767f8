"""``rknpu bench sim``: wiring and one small measurement (the benchmark itself is a command,
not a timed test: nothing here asserts a speed)."""

from __future__ import annotations

import argparse

import numpy as np

import ggml_rknpu
from ggml_rknpu.bench import sim as sim_bench
from ggml_rknpu.cli import bench as cli_bench


def test_the_subcommand_is_wired():
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    args = parser.parse_args(["sim", "--device", "sim-rocket", "--kinds", "decode", "--iters", "2"])
    assert (args.bench, args.device, args.kinds, args.iters) == ("sim", "sim-rocket", "decode", 2)


def test_a_measured_row_is_consistent():
    npu = ggml_rknpu.open(device="sim-rknpu")
    try:
        row = sim_bench.measure(npu, sim_bench.SimShape(3, 64, 48, "decode"), "fp16", 2,
                                np.random.default_rng(0))
        assert npu.counters["weights_freed"] == 1     # the benchmark frees what it uploads
    finally:
        npu.close()
    assert row["sim_ms_measured"] > 0 and row["numpy_ms_measured"] > 0
    assert np.isclose(row["ratio_measured"], row["sim_ms_measured"] / row["numpy_ms_measured"])
    assert 0 < row["sim_share_measured"] <= 1
    assert row["verdict"] == ("ok" if row["ratio_measured"] <= sim_bench.GOAL_RATIO else "SLOW")


def test_unknown_kinds_are_refused(capsys):
    args = argparse.Namespace(kinds="sideways", device="sim-rknpu", cores=3, dtype="fp16", iters=1,
                              out="unused")
    from rich.console import Console

    assert sim_bench.run(args, Console()) == 2
