"""Open the NPU, print what the driver and hardware report, and round-trip a buffer
(create -> map -> write -> sync to device -> sync from device -> read back -> destroy).
It says which kernel interface was used (vendor rknpu DRM or mainline rocket accel) and
whether it is the simulator.

Exit codes (stable, for scripts):
  0  device opened, facts read, round trip matched
  1  round trip mismatch: the bytes read back differ from the bytes written
  2  no usable device: nothing found, cannot open, or unknown --device
  3  a driver call failed during the round trip (allocation, map, sync, destroy)
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ggml_rknpu.devices import DEVICE_CHOICES, open_device
from ggml_rknpu.kernel.device import DeviceInfo, NpuDevice
from ggml_rknpu.kernel.errors import NpuError

EXIT_OK, EXIT_MISMATCH, EXIT_NO_DEVICE, EXIT_DRIVER_ERROR = 0, 1, 2, 3
INTERFACES = {"rknpu": "vendor rknpu DRM driver", "rocket": "mainline rocket DRM accel driver"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--device", default=None,
                        help=f"{' | '.join(DEVICE_CHOICES)} | a /dev path (default: $RKNPU_DEVICE, else auto: "
                             "vendor, rocket, simulator)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--size", type=_positive_int, default=1 << 20,
                        help="round-trip buffer size in bytes (default 1 MiB)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, not {value}")
    return value


def _round_trip(dev: NpuDevice, size: int) -> dict:
    start = time.perf_counter()
    pattern = np.random.default_rng(0x3588).integers(0, 256, size, dtype=np.uint8)
    with dev.alloc(size) as buf:
        dma_addr = buf.dma_addr
        buf.array()[:] = pattern
        buf.sync_to_device()
        buf.sync_from_device()
        mismatched = int(np.count_nonzero(buf.array() != pattern))
    return {
        "bytes": size, "dma_addr": dma_addr, "match": mismatched == 0, "mismatched_bytes": mismatched,
        "host_seconds_measured": round(time.perf_counter() - start, 6),
    }


def _facts(info: DeviceInfo, free: int, total: int) -> list[tuple[str, str]]:
    def opt(value, fmt=str) -> str:
        return "n/a (not in this ABI)" if value is None else fmt(value)

    volt = opt(info.npu_volt_uv, lambda v: f"{v / 1e6:.3f} V" + (" (simulator placeholder)" if info.simulated else ""))
    return [
        ("kernel interface", f"{info.kind}: {INTERFACES[info.kind]}"),
        ("simulated", "yes (no NPU hardware used)" if info.simulated else "no (real device)"),
        ("device node", info.path),
        ("driver", f"{info.driver_name} {info.driver_version} ({info.driver_desc}, date {info.driver_date})"),
        ("NPU cores", str(info.n_cores)),
        ("hardware version", opt(info.hw_version, lambda v: f"{v:#010x}")),
        ("NPU clock", opt(info.npu_freq_hz, lambda v: f"{v / 1e6:.0f} MHz")),
        ("NPU voltage", volt),
        ("IOMMU", opt(info.iommu_enabled, lambda v: "enabled" if v else "disabled")),
        ("SRAM total / free", "n/a (not in this ABI)" if info.sram_total_bytes is None
         else f"{info.sram_total_bytes} / {info.sram_free_bytes} bytes"),
        ("NPU address space free", f"{free / 2**20:.1f} of {total / 2**20:.1f} MiB"
         + ("" if info.simulated else " (estimate: this process's buffers only)")),
    ]


def _print_tables(facts: list[tuple[str, str]], trip: dict | None, error: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if facts:
        table = Table(title="rknpu probe", show_header=False)
        table.add_column("fact", style="bold")
        table.add_column("value")
        for key, value in facts:
            table.add_row(key, value)
        console.print(table)
    if trip is not None:
        verdict = "[green]match[/green]" if trip["match"] else f"[red]MISMATCH ({trip['mismatched_bytes']} bytes)[/red]"
        console.print(f"buffer round trip: {trip['bytes']} bytes at NPU address {trip['dma_addr']:#x}: {verdict} "
                      f"({trip['host_seconds_measured'] * 1e3:.2f} ms host time, measured)")
    if error:
        console.print(f"[red]error:[/red] {error}")


def run(args: argparse.Namespace) -> int:
    try:
        dev = open_device(args.device)
    except NpuError as exc:
        return _report(args, EXIT_NO_DEVICE, None, None, None, str(exc))
    with dev:
        try:
            info = dev.info()
            free, total = dev.iova_budget()
        except NpuError as exc:
            return _report(args, EXIT_NO_DEVICE, None, None, None, f"cannot read device facts: {exc}")
        try:
            trip = _round_trip(dev, args.size)
        except NpuError as exc:
            return _report(args, EXIT_DRIVER_ERROR, info, (free, total), None, f"round trip failed: {exc}")
    code = EXIT_OK if trip["match"] else EXIT_MISMATCH
    return _report(args, code, info, (free, total), trip, None if trip["match"] else "read-back differs from written data")


def _report(args, code: int, info: DeviceInfo | None, budget: tuple[int, int] | None, trip: dict | None,
            error: str | None) -> int:
    if args.json:
        out: dict = {"ok": code == EXIT_OK, "exit_code": code, "error": error}
        if info is not None:
            out.update(interface=info.kind, simulated=info.simulated, device=info.as_dict())
        if budget is not None:
            out.update(iova_free_bytes=budget[0], iova_total_bytes=budget[1])
        out["round_trip"] = trip
        print(json.dumps(out))
    else:
        facts = _facts(info, *budget) if info is not None and budget is not None else []
        _print_tables(facts, trip, error)
    return code
