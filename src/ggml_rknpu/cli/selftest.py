"""Validate this project on the board (or the simulator) and write one archive to share.

Runs: probe (open the NPU, facts, a buffer round trip), check-rig, the bring-up ladder
(safest rung first; stops at the first failure; records what this board and driver
passed in ~/.config/ggml-rknpu/envelope.json, which widens the envelope the engine and
``rknpu serve`` plan in), then a sweep of matmul shapes in fp16 and int8 on 1 and all the
cores the ladder allowed, compared against numpy (int8 exact, fp16 within a documented
tolerance), a timing sweep, then writes selftest.json + selftest.md and a tar.gz of both
into --out. Exit code 0 on PASS, 1 on FAIL.
Set RKNPU_SELFTEST_CORRUPT=1 to flip one output element and see it fail
(RKNPU_SELFTEST_CORRUPT=<rung> for a ladder rung).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.panel import Panel

from ggml_rknpu.bench.selftest import build_report, run_selftest, write_archive
from ggml_rknpu.cli.check_rig import render as render_rig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="rknpu | rocket | sim-rknpu | sim-rocket (default: auto)")
    parser.add_argument("--out", type=Path, default=Path("selftest-out"), metavar="DIR")
    parser.add_argument("--rig-root", default="/", metavar="DIR", help="filesystem root check-rig reads")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per timing case")


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        result = run_selftest(args.device, rig_root=args.rig_root, console=console, iters=args.iters)
    except Exception as exc:  # the kit must end with a verdict, not a traceback
        console.print(Panel(f"selftest could not run: {type(exc).__name__}: {exc}", title="FAIL",
                            border_style="bold red"))
        return 1
    render_rig(result.rig, console)
    report = build_report(result)
    report.print(console)
    archive = write_archive(report, args.out)
    where = "simulator: device times are modeled" if result.simulated else "board"
    envelope = f"envelope now: {result.envelope}\nrecorded in: {result.envelope_record}"
    if result.passed:
        console.print(Panel(f"PASS ({len(result.ladder)} rungs, {len(result.cases)} cases, {where})\n{envelope}\n"
                            f"archive: {archive}", title="selftest", border_style="green"))
        return 0
    body = "\n".join(result.failures[:20])
    console.print(Panel(f"{len(result.failures)} failure(s) ({where}):\n{body}\n{envelope}\narchive: {archive}",
                        title="selftest FAIL", border_style="bold red"))
    return 1
