"""Is this board fit to be benchmarked? Read its clocks, governors, temperatures and NPU driver.

Invariants: everything is read under a filesystem ``root`` (default ``/``), so a copied or
fake sysfs tree (tests/fixtures/rigs/) is diagnosed the same way; nothing here writes to
sysfs: each finding carries its source and the command that fixes it, for the user to run.
Thermal fallback thresholds are guesses, marked. Why and the sources of every path and
threshold: docs/decisions.md "bench/rig.py"."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ggml_rknpu.cost.model import VENDOR_CLOCK, NpuClock
from ggml_rknpu.kernel.rknpu.uapi import ABI_DOMAINS_VERSION

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
_SEVERITY = {SKIP: 0, PASS: 1, WARN: 2, FAIL: 3}

NOT_A_BOARD = "not an RK3588 board: figures will be modeled"

DMC_DIR = "/sys/class/devfreq/dmc"
NPU_DEVFREQ_DIR = "/sys/class/devfreq/fdab0000.npu"
CPUFREQ_DIR = "/sys/devices/system/cpu/cpufreq"
THERMAL_DIR = "/sys/class/thermal"
DT_COMPATIBLE = "/proc/device-tree/compatible"
DT_MODEL = "/proc/device-tree/model"
OSRELEASE = "/proc/sys/kernel/osrelease"
CPUINFO = "/proc/cpuinfo"
RKNPU_MODULE_VERSION = "/sys/module/rknpu/version"
RKNPU_DEBUGFS_VERSION = "/sys/kernel/debug/rknpu/version"
ROCKET_MODULE = "/sys/module/rocket"
ROCKET_DRIVER = "/sys/bus/platform/drivers/rocket"

DRAM_MAX_MHZ_RK3588 = 2112          # [docs/anchors.md A3; docs/history.md §15]
NPU_VENDOR_MHZ = 1000               # [seed log "Target interface"; docs/anchors.md §3.1]
NPU_ROCKET_BOOT_MHZ = 200           # [docs/anchors.md §3.1]
# SUBMIT reports hw_elapse_time from the ABI with IOMMU domains on
# [docs/npu-programming.md "What the drivers really do" (UAPI layouts)]
RKNPU_HW_ELAPSE_VERSION = ABI_DOMAINS_VERSION
RKNPU_OLDEST_SUPPORTED = (0, 9, 6)  # [docs/anchors.md §2: runtime coupled to 0.9.6-0.9.8]
# Arm MIDR_EL1 part numbers (Arm Cortex-A55/A76 TRMs; general knowledge, not in reference/).
CPU_PARTS = {0xD05: "Cortex-A55", 0xD0B: "Cortex-A76"}
# Thermal fallbacks when a zone exposes no passive trip point: GUESSES, not sourced.
FALLBACK_THROTTLE_C = 85.0          # guess: typical RK3588 DT passive trip
WARN_MARGIN_C = 10.0                # guess: within 10 degC of throttling, a sustained run will cross it

DMC_FIX = "echo performance > /sys/class/devfreq/dmc/governor"
CPU_FIX = "echo performance | tee /sys/devices/system/cpu/cpufreq/policy*/scaling_governor"
NPU_FIX = "echo performance > /sys/class/devfreq/fdab0000.npu/governor"
# Mainline rocket has no devfreq: the clock framework's debugfs summary (root) shows the NPU's
# clocks; its columns are name, enable, prepare, protect counts, then the rate in Hz [Linux clk.c]
CLK_SUMMARY = "/sys/kernel/debug/clk/clk_summary"
ROCKET_CLOCK_FIX = ("apply the out-of-tree patch that raises the NPU clock to 600 MHz (docs/anchors.md A8), "
                    "or use a vendor kernel (rknpu, 1 GHz)")


@dataclass(frozen=True)
class Check:
    """One finding: what was read, whether it is fit for benchmarking, why, and the fix."""

    name: str
    status: str
    value: str
    reason: str
    fix: str = ""
    source: str = ""


@dataclass
class RigReport:
    root: str
    on_board: bool
    board: str
    verdict: str
    summary: str
    checks: list[Check] = field(default_factory=list)
    snapshot: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.verdict == FAIL

    def to_dict(self) -> dict:
        return {
            "root": self.root, "on_board": self.on_board, "board": self.board,
            "verdict": self.verdict, "summary": self.summary,
            "checks": [asdict(c) for c in self.checks], "snapshot": self.snapshot,
        }


class Sysfs:
    """Read-only access to sysfs/procfs files under a root; missing or unreadable -> None."""

    def __init__(self, root: str | Path = "/") -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"--root {root}: not a directory (give a copied or fake filesystem root)")

    def path(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def read(self, path: str) -> str | None:
        try:
            return self.path(path).read_text(errors="replace").strip("\n\x00 ")
        except OSError:
            return None

    def read_int(self, path: str) -> int | None:
        text = self.read(path)
        try:
            return int(text.split()[0]) if text else None
        except ValueError:
            return None

    def exists(self, path: str) -> bool:
        return self.path(path).exists()

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(p.name for p in self.path(path).iterdir())
        except OSError:
            return []


def _mhz(hz: int | None) -> float | None:
    return None if hz is None else hz / 1e6


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def board_identity(fs: Sysfs) -> tuple[bool, str]:
    """(is RK3588 or RK3588S, description) from the device-tree compatible list."""
    compatible = (fs.read(DT_COMPATIBLE) or "").split("\x00")
    model = fs.read(DT_MODEL) or ""
    on_board = any(c.startswith("rockchip,rk3588") for c in compatible)
    desc = model or ", ".join(c for c in compatible if c) or "unknown machine (no device tree)"
    return on_board, desc


def cpu_parts(fs: Sysfs) -> dict[int, str]:
    """cpu index -> core name from /proc/cpuinfo's 'CPU part' lines."""
    parts: dict[int, str] = {}
    cpu = None
    for line in (fs.read(CPUINFO) or "").splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "processor" and val.isdigit():
            cpu = int(val)
        elif key == "CPU part" and cpu is not None:
            try:
                parts[cpu] = CPU_PARTS.get(int(val, 16), val)
            except ValueError:
                parts[cpu] = val
    return parts


def _cpulist(text: str | None) -> list[int]:
    cpus: list[int] = []
    for tok in (text or "").replace(",", " ").split():
        lo, _, hi = tok.partition("-")
        if lo.isdigit():
            cpus.extend(range(int(lo), int(hi) + 1) if hi.isdigit() else [int(lo)])
    return cpus


def read_cpufreq(fs: Sysfs) -> list[dict]:
    """Every cpufreq policy: cpus, cluster name, governor, cur/max kHz."""
    parts = cpu_parts(fs)
    policies = []
    for name in sorted((n for n in fs.listdir(CPUFREQ_DIR) if n.startswith("policy")), key=_natural):
        base = f"{CPUFREQ_DIR}/{name}"
        cpus = _cpulist(fs.read(f"{base}/related_cpus") or fs.read(f"{base}/affected_cpus"))
        kinds = sorted({parts[c] for c in cpus if c in parts})
        policies.append({
            "policy": name, "cpus": cpus, "cluster": "/".join(kinds) or "unknown",
            "governor": fs.read(f"{base}/scaling_governor"),
            "cur_khz": fs.read_int(f"{base}/scaling_cur_freq"),
            "max_khz": fs.read_int(f"{base}/scaling_max_freq"),
            "hw_max_khz": fs.read_int(f"{base}/cpuinfo_max_freq"),
        })
    return policies


def read_devfreq(fs: Sysfs, base: str) -> dict | None:
    if not fs.exists(base):
        return None
    steps = [int(t) / 1e6 for t in (fs.read(f"{base}/available_frequencies") or "").split() if t.isdigit()]
    return {"governor": fs.read(f"{base}/governor"), "cur_mhz": _mhz(fs.read_int(f"{base}/cur_freq")),
            "max_mhz": _mhz(fs.read_int(f"{base}/max_freq")), "available_mhz": [m for m in steps if m > 0] or None}


def read_thermal(fs: Sysfs) -> list[dict]:
    """Every thermal zone: type, temperature (degC) and its lowest passive/hot trip (degC)."""
    zones = []
    for name in sorted((n for n in fs.listdir(THERMAL_DIR) if n.startswith("thermal_zone")), key=_natural):
        base = f"{THERMAL_DIR}/{name}"
        temp = fs.read_int(f"{base}/temp")
        trips = []
        for entry in fs.listdir(base):
            m = re.fullmatch(r"trip_point_(\d+)_type", entry)
            if m and (fs.read(f"{base}/{entry}") or "") in ("passive", "hot"):
                t = fs.read_int(f"{base}/trip_point_{m.group(1)}_temp")
                if t is not None:
                    trips.append(t / 1000)
        zones.append({"zone": name, "type": fs.read(f"{base}/type") or name,
                      "temp_c": None if temp is None else temp / 1000,
                      "throttle_c": min(trips) if trips else None})
    return zones


def snapshot(root: str | Path = "/") -> dict:
    """Clocks and temperatures right now; cheap enough to take once per sustained window."""
    fs = Sysfs(root)
    dmc = read_devfreq(fs, DMC_DIR)
    npu = read_devfreq(fs, NPU_DEVFREQ_DIR)
    clocks = read_npu_clocks(fs) if npu is None else []    # mainline: no devfreq, the clock framework
    return {
        "dram_mhz": dmc["cur_mhz"] if dmc else None,
        "npu_mhz": npu["cur_mhz"] if npu else clocks[0][1] if clocks else None,
        "cpu_mhz": {p["policy"]: (p["cur_khz"] / 1000 if p["cur_khz"] else None) for p in read_cpufreq(fs)},
        "temps_c": {z["type"]: z["temp_c"] for z in read_thermal(fs)},
    }


def _version(text: str | None) -> tuple[int, ...] | None:
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", text or "")
    return tuple(int(g) for g in m.groups()) if m else None


def check_dram(fs: Sysfs) -> Check:
    src = "docs/history.md §15; docs/anchors.md §3.2 pitfalls (sbc-reviews#2, rknn-llm#532)"
    dmc = read_devfreq(fs, DMC_DIR)
    if dmc is None:
        return Check("dram", WARN, "no /sys/class/devfreq/dmc",
                     "DRAM clock cannot be verified: no DMC devfreq (bootloader without DMC DVFS, or a "
                     "mainline kernel); decode figures depend on it directly",
                     "check the boot blob runs DRAM at 2112 MHz (e.g. rk3588_ddr_lp4_2112MHz) and compare "
                     "with the published figures in docs/anchors.md §3", src)
    cur, top, gov = dmc["cur_mhz"], dmc["max_mhz"], dmc["governor"]
    top_avail = max(dmc["available_mhz"] or [top or 0])
    top = max(top or 0, top_avail) or None
    value = f"{cur:.0f} of {top:.0f} MHz, governor {gov}" if cur and top else f"governor {gov}"
    if cur is None or top is None:
        return Check("dram", WARN, value, "DRAM cur/max frequency unreadable", DMC_FIX, src)
    if cur < top * 0.98:
        return Check("dram", FAIL, value,
                     f"DRAM at {cur:.0f} MHz of {top:.0f}: decode is bandwidth-bound, figures would be "
                     f"~{top / cur:.1f}x too slow (seed log retraction)", DMC_FIX, src)
    if gov != "performance":
        return Check("dram", WARN, value,
                     f"DRAM at max now but governor '{gov}' may step it down between runs", DMC_FIX, src)
    if top < DRAM_MAX_MHZ_RK3588 * 0.98:
        return Check("dram", WARN, value,
                     f"DRAM max {top:.0f} MHz is below RK3588's {DRAM_MAX_MHZ_RK3588} MHz: compare only with "
                     "figures taken at the same DRAM clock", "", src + "; docs/anchors.md A3")
    return Check("dram", PASS, value, "DRAM pinned at its maximum", "", src)


def check_cpus(fs: Sysfs) -> list[Check]:
    src = "docs/history.md §15-16; docs/anchors.md §2 (rknn-llm#27, #29), §3.1"
    policies = read_cpufreq(fs)
    if not policies:
        return [Check("cpufreq", WARN, "no cpufreq policies",
                      "CPU clocks cannot be verified; the CPU side of a CPU-vs-NPU fight may be throttled",
                      "enable cpufreq in the kernel, or pin clocks in the bootloader", src)]
    checks = []
    for p in policies:
        name = f"cpu {p['policy']} ({p['cluster']}, cpus {_fmt_cpus(p['cpus'])})"
        cur = p["cur_khz"] / 1000 if p["cur_khz"] else None
        cap = p["max_khz"] / 1000 if p["max_khz"] else None
        hw = p["hw_max_khz"] / 1000 if p["hw_max_khz"] else cap
        value = f"{cur or 0:.0f} of {hw or 0:.0f} MHz, governor {p['governor']}"
        if p["governor"] == "powersave":
            checks.append(Check(name, FAIL, value, "governor 'powersave' pins the cluster at its lowest clock",
                                CPU_FIX, src))
        elif cap and hw and cap < hw * 0.98:
            checks.append(Check(name, FAIL, value, f"scaling_max_freq caps the cluster at {cap:.0f} of {hw:.0f} MHz",
                                f"cat {CPUFREQ_DIR}/{p['policy']}/cpuinfo_max_freq > "
                                f"{CPUFREQ_DIR}/{p['policy']}/scaling_max_freq", src))
        elif p["governor"] != "performance":
            checks.append(Check(name, WARN, value,
                                f"governor '{p['governor']}' ramps with load: short bursts measure cold clocks "
                                "(docs/history.md §12)", CPU_FIX, src))
        elif cur and hw and cur < hw * 0.98:
            checks.append(Check(name, WARN, value,
                                f"performance governor but running at {cur:.0f} of {hw:.0f} MHz "
                                "(thermal or power limit?)", "check temperatures and the power supply", src))
        else:
            checks.append(Check(name, PASS, value, "pinned at its maximum", "", src))
        if checks[-1].status == FAIL and p["cluster"] == "Cortex-A55":
            # benchmarks pin to the A76 cores 4-7 [docs/history.md §16]: a slow A55 cluster only
            # slows what is left unpinned, so it warns instead of refusing the run
            c = checks[-1]
            checks[-1] = Check(c.name, WARN, c.value, c.reason + " (little cores: benchmarks pin to the big "
                               "cores 4-7, but unpinned helpers run here)", c.fix, c.source)
    return checks


def _fmt_cpus(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)) else \
        ",".join(map(str, cpus)) or "?"


def read_npu_clocks(fs: Sysfs) -> list[tuple[str, float]]:
    """(name, MHz) of every clock named like the NPU's in the clock summary, fastest first."""
    clocks = []
    for line in (fs.read(CLK_SUMMARY) or "").splitlines():
        parts = line.split()
        if len(parts) >= 5 and "npu" in parts[0].lower() and parts[4].isdigit():
            clocks.append((parts[0], int(parts[4]) / 1e6))
    return sorted(clocks, key=lambda c: -c[1])


def _check_npu_clk(clocks: list[tuple[str, float]], rocket: bool, src: str) -> Check:
    """The NPU clock from the clock framework (mainline: no devfreq node)."""
    top = clocks[0][1]
    value = ", ".join(f"{name} {mhz:.0f} MHz" for name, mhz in clocks[:3]) + " (clk_summary)"
    if rocket and top <= NPU_ROCKET_BOOT_MHZ * 1.02:
        return Check("npu clock", WARN, value,
                     f"NPU at mainline rocket's boot clock, {NPU_ROCKET_BOOT_MHZ} MHz: device time is "
                     f"{NPU_VENDOR_MHZ / NPU_ROCKET_BOOT_MHZ:.0f}x the vendor driver's", ROCKET_CLOCK_FIX, src)
    if top < NPU_VENDOR_MHZ * 0.98:
        return Check("npu clock", WARN, value, f"NPU at {top:.0f} MHz, below the vendor driver's {NPU_VENDOR_MHZ} MHz",
                     "compare only with figures taken at the same NPU clock", src)
    return Check("npu clock", PASS, value, "NPU at 1 GHz", "", src)


def check_npu_clock(fs: Sysfs, rocket: bool) -> Check:
    src = "seed log 'Target interface' (1 GHz); docs/anchors.md §3.1 (vendor 1 GHz, rocket boots at 200 MHz)"
    npu = read_devfreq(fs, NPU_DEVFREQ_DIR)
    if npu is None and (clocks := read_npu_clocks(fs)):
        return _check_npu_clk(clocks, rocket, src)
    if npu is None:
        reason = "NPU clock cannot be read (no fdab0000.npu devfreq, no NPU clock in the debugfs clk_summary)"
        if rocket:
            reason += f"; mainline rocket boots the NPU at {NPU_ROCKET_BOOT_MHZ} MHz unless patched"
        return Check("npu clock", WARN, "no devfreq node", reason,
                     "compare with figures taken at a known NPU clock (docs/anchors.md A8: rocket at 600 MHz)", src)
    cur, top, gov = npu["cur_mhz"], npu["max_mhz"], npu["governor"]
    value = f"{cur or 0:.0f} of {top or 0:.0f} MHz, governor {gov}"
    if cur is None:
        return Check("npu clock", WARN, value, "NPU cur_freq unreadable", NPU_FIX, src)
    if cur < NPU_VENDOR_MHZ * 0.98 and top and cur < top * 0.98:
        return Check("npu clock", WARN, value,
                     f"NPU at {cur:.0f} MHz of {top:.0f}: device time scales with it", NPU_FIX, src)
    if cur < NPU_VENDOR_MHZ * 0.98:
        return Check("npu clock", WARN, value,
                     f"NPU maximum {cur:.0f} MHz is below the vendor driver's {NPU_VENDOR_MHZ} MHz",
                     "compare only with figures taken at the same NPU clock", src)
    return Check("npu clock", PASS, value, "NPU at 1 GHz", "", src)


def check_thermal(fs: Sysfs) -> Check:
    src = "kernel trip points (trip_point_*_temp); fallbacks are guesses; docs/history.md §12 (40-47 degC: no throttling)"
    zones = [z for z in read_thermal(fs) if z["temp_c"] is not None]
    if not zones:
        return Check("thermal", WARN, "no thermal zones", "temperatures cannot be read: throttling would go unseen",
                     "enable the thermal zones in the device tree", src)
    hottest = max(zones, key=lambda z: z["temp_c"] - (z["throttle_c"] or FALLBACK_THROTTLE_C))
    limit = hottest["throttle_c"] or FALLBACK_THROTTLE_C
    temps = ", ".join(f"{z['type']} {z['temp_c']:.0f}" for z in zones)
    value = f"{temps} degC"
    where = f"{hottest['type']} at {hottest['temp_c']:.1f} degC"
    limit_src = "its passive trip" if hottest["throttle_c"] else "the guessed limit"
    cool_fix = "let the board cool (idle a few minutes), fit a heatsink/fan, then re-run check-rig"
    if hottest["temp_c"] >= limit:
        return Check("thermal", FAIL, value, f"{where}, at or above {limit_src} {limit:.0f} degC: clocks are throttled",
                     cool_fix, src)
    if hottest["temp_c"] >= limit - WARN_MARGIN_C:
        return Check("thermal", WARN, value,
                     f"{where}, within {WARN_MARGIN_C:.0f} degC of {limit_src} {limit:.0f} degC: a sustained run "
                     "will throttle", cool_fix, src)
    return Check("thermal", PASS, value, f"hottest {where}, {limit - hottest['temp_c']:.0f} degC below throttling",
                 "", src)


def check_driver(fs: Sysfs) -> tuple[Check, bool]:
    """The NPU kernel driver; returns (check, rocket_present)."""
    src = ("docs/anchors.md §2 (driver versions: ezrknn-llm#19, armbian PR #170); docs/npu-programming.md "
           "\"What the drivers really do\", UAPI layouts (hw_elapse_time from 0.9.5)")
    kernel = fs.read(OSRELEASE) or "unknown kernel"
    rocket = fs.exists(ROCKET_MODULE) or fs.exists(ROCKET_DRIVER)
    debugfs = fs.read(RKNPU_DEBUGFS_VERSION)
    module = fs.read(RKNPU_MODULE_VERSION)
    version = _version(debugfs) or _version(module)
    vendor = version is not None or fs.exists("/sys/module/rknpu")
    if vendor:
        vtxt = ".".join(map(str, version)) if version else "unknown version"
        value = f"rknpu {vtxt} (kernel {kernel})" + (" + rocket" if rocket else "")
        if rocket:
            return Check("npu driver", FAIL, value, "both rknpu and rocket are loaded: they drive the same NPU",
                         "blacklist one of them (modprobe -r rocket)", src), rocket
        if version is None:
            return Check("npu driver", WARN, value,
                         "rknpu version unreadable: cannot tell whether hw_elapse_time (device time) is reported",
                         "mount debugfs (mount -t debugfs none /sys/kernel/debug) and re-run as root", src), rocket
        if version < RKNPU_HW_ELAPSE_VERSION:
            return Check("npu driver", WARN, value,
                         f"rknpu {vtxt} has no hw_elapse_time (nor IOMMU domains): device time will be modeled, "
                         "not measured", "upgrade the vendor kernel's rknpu driver to 0.9.8", src), rocket
        if version < RKNPU_OLDEST_SUPPORTED:
            return Check("npu driver", WARN, value, f"rknpu {vtxt} predates 0.9.6",
                         "upgrade the vendor kernel's rknpu driver to 0.9.8", src), rocket
        return Check("npu driver", PASS, value, "vendor driver with hw_elapse_time: device time is measured",
                     "", src), rocket
    if rocket:
        return Check("npu driver", WARN, f"rocket (mainline, kernel {kernel})",
                     "mainline rocket driver: no hw_elapse_time, so device time is modeled; the NPU boots at "
                     f"{NPU_ROCKET_BOOT_MHZ} MHz unless the clock is patched (docs/anchors.md A8)",
                     "for measured device time use a vendor kernel with rknpu 0.9.8", src), rocket
    return Check("npu driver", FAIL, f"none (kernel {kernel})", "no NPU driver loaded (neither rknpu nor rocket)",
                 "boot a vendor kernel with rknpu, or mainline >= 6.18 with CONFIG_DRM_ACCEL_ROCKET "
                 "(modprobe rocket)", src), rocket


NPU_NODES = ("/dev/dri/renderD129", "/dev/accel/accel0")   # vendor render node, rocket accel node
# [seed log "Target interface" (renderD129); docs/npu-programming.md §5 / rocket uAPI (accel0)]


def npu_users(fs: Sysfs) -> tuple[list[str], int]:
    """Processes holding an NPU device node open: (["pid comm", ...], unreadable fd dirs).
    Reads /proc/<pid>/fd symlinks; other users' fds need root and are counted, not guessed."""
    users, unreadable = [], 0
    for pid in (p for p in fs.listdir("/proc") if p.isdigit()):
        fd_dir = fs.path(f"/proc/{pid}/fd")
        try:
            targets = {os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)}
        except OSError:
            unreadable += fs.exists(f"/proc/{pid}/fd")
            continue
        if targets & set(NPU_NODES):
            users.append(f"{pid} {fs.read(f'/proc/{pid}/comm') or '?'}")
    return users, unreadable


def check_npu_users(fs: Sysfs) -> Check:
    src = "docs/anchors.md §4 gotchas (rk-llama.cpp README, igou-io PR #869: concurrent NPU processes panic the kernel)"
    users, unreadable = npu_users(fs)
    skipped = f" ({unreadable} processes' fds unreadable: run as root to see all)" if unreadable else ""
    if users:
        return Check("npu users", WARN, ", ".join(users),
                     "another process holds the NPU open: its jobs share the cores and skew the figures, and "
                     "concurrent NPU processes can panic the kernel" + skipped,
                     f"stop it (kill {users[0].split()[0]}) before benchmarking", src)
    return Check("npu users", PASS, "none", "no other process holds the NPU open" + skipped, "", src)


def npu_clock(report: RigReport) -> NpuClock:
    """The NPU clock to model device time at: this board's, as check-rig read it (devfreq, or
    the clock framework under mainline), else the vendor driver's (off a board, or unreadable)."""
    mhz = report.snapshot.get("npu_mhz") if report.on_board else None
    return NpuClock(mhz, "check-rig: this board's NPU clock now") if mhz else VENDOR_CLOCK


def check_rig(root: str | Path = "/") -> RigReport:
    """Every check under ``root``; the verdict is the worst status."""
    fs = Sysfs(root)
    on_board, board = board_identity(fs)
    snap = snapshot(root)
    if not on_board:
        check = Check("soc", SKIP, board, NOT_A_BOARD, "",
                      "device-tree compatible lacks rockchip,rk3588")
        return RigReport(str(root), False, board, SKIP, NOT_A_BOARD, [check], snap)
    driver, rocket = check_driver(fs)
    checks = [Check("soc", PASS, board, "RK3588 device tree", "", "/proc/device-tree/compatible"),
              check_dram(fs), *check_cpus(fs), check_npu_clock(fs, rocket), check_thermal(fs), driver,
              check_npu_users(fs)]
    verdict = max((c.status for c in checks), key=_SEVERITY.__getitem__)
    bad = [c for c in checks if c.status == verdict and verdict != PASS]
    summary = "rig fit for benchmarking" if verdict == PASS else "; ".join(dict.fromkeys(c.reason for c in bad))
    return RigReport(str(root), True, board, verdict, summary, checks, snap)
