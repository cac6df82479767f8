"""Check DRAM/CPU/NPU clocks, governors, thermals and the NPU driver before benchmarking.

Each check prints PASS/WARN/FAIL with the reason and the command that fixes it.
Exit code 1 on FAIL, 0 otherwise (also on a machine that is not an RK3588 board,
where benchmarks run on the simulator and print modeled figures).
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from ggml_rknpu.bench.rig import FAIL, PASS, SKIP, WARN, RigReport, check_rig

_STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "cyan"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--root", default="/", metavar="DIR",
                        help="read sysfs/procfs under DIR instead of / (a copied or fake tree)")


def render(report: RigReport, console: Console | None = None) -> None:
    """The rig report as a rich table (used by check-rig and at the top of every bench)."""
    console = console or Console()
    table = Table(title=f"rig: {report.board}", show_lines=False)
    for col in ("check", "status", "value", "reason", "fix"):
        table.add_column(col, overflow="fold")
    for c in report.checks:
        table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.value, c.reason, c.fix)
    console.print(table)
    console.print(f"verdict: [{_STYLE[report.verdict]}]{report.verdict}[/] - {report.summary}")


def run(args: argparse.Namespace) -> int:
    try:
        report = check_rig(args.root)
    except FileNotFoundError as exc:
        print(f"check-rig: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report)
    return 1 if report.failed else 0
