"""Helpers the bench and rknn CLI tests share: the fake sysfs rigs, ``rknpu bench`` run
in-process, a PNG check, the real engine on the simulator, and the ladder's cheap golden
shapes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from PIL import Image

from ggml_rknpu.cli import bench as bench_cli

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"

# The bring-up ladder's golden rung with cheap shapes (the full rung runs in the slow test
# of tests/bench/test_bench_ladder.py).
SMALL_GOLDEN = ((1, 32, 16, "fp16", "fp32"), (1, 32, 16, "fp16", "fp16"), (1, 64, 64, "int8", "int32"),
                (544, 544, 4096, "int8", "int32"))


def run_bench_cli(*argv: str) -> int:
    """``rknpu bench ARGV`` in this process; its exit status."""
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return bench_cli.run(parser.parse_args(list(argv)))


def valid_png(path: Path) -> tuple[int, int]:
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def engine_or_skip(device: str = "sim-rknpu"):
    """The real engine on the simulator; skipped only while its layers are genuinely absent."""
    import numpy as np

    import ggml_rknpu
    from ggml_rknpu.kernel.errors import NpuError

    try:
        npu = ggml_rknpu.open(device=device, cores=1)
    except ModuleNotFoundError as exc:
        pytest.skip(f"engine dependency not in the tree yet: {exc}")
    try:
        npu.matmul(np.ones((1, 32), np.float32), npu.upload_weight(np.ones((16, 32), np.float32)))
    except NpuError as exc:
        if "no NPU model attached" in str(exc):
            pytest.skip(f"simulated NPU (sim/npu.py) not in the tree yet: {exc}")
        raise
    finally:
        npu.close()
