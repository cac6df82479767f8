"""Helpers the bench and rknn CLI tests share: the fake sysfs rigs, ``rknpu bench`` run
in-process, a PNG check, the real engine on the simulator, and the ladder's cheap golden
shapes."""

from __future__ import annotations

import argparse
from pathlib import Path

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
