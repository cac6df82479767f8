"""The time a matmul program would take on RK3588 silicon: a *modeled* figure, never a
measured one; every figure it produces must be printed as modeled.

Per task: compute (M padded to 16, K to 32, N to the kernel group, over the MAC rate),
memory (the task's weights + A + C over the per-core share of the DRAM stream), task time
= max + ``OVERLAP_PENALTY`` * min + ``TASK_OVERHEAD``; a core sums its tasks, a job is its
slowest core plus the submit path's overhead (``SubmitProfile``). Every constant cites its
source; FIT constants reproduce ``ANCHORS`` (tests/cost/test_cost_model.py shows the fit).
Why a separate model and the terms' sources: docs/decisions.md "cost/model.py"."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up, ceil_div

# --- hardware rates -------------------------------------------------------------------
MACS_PER_CYCLE_PER_CORE = {"fp16": 512, "int8": 1024}
# [docs/anchors.md A1 / §3.1: 1024 INT8 MAC/cycle/core; TRM NPU chapter; docs/rknn-toolkit.md §1.7:
#  Rockchip's compiler cost model implies 512 fp16 and 1024 int8 MAC/cycle]
IN_BYTES = {d: limits.BYTES[d] for d in ("fp16", "int8")}
KERNEL_GROUP = limits.KERNEL_GROUP  # N padding [docs/npu-programming.md §6 B layouts]
K_ALIGN = limits.K_ALIGN  # [docs/npu-programming.md §6: K padded to 32]
M_ATOM = 16  # M padded to 16 per task [docs/rknn-toolkit.md §1.7: M=1 runs at 1/16 of the MAC rate]

DRAM_BYTES_PER_TRANSFER = 8  # 4 x 16-bit LPDDR4x channels [docs/anchors.md A3]
DRAM_TRANSFERS_PER_CLOCK = 2  # double data rate: 2112 MHz -> 33.8 GB/s nominal [docs/anchors.md A3]
NPU_DRAM_EFFICIENCY = 30.9 / 33.792
# [docs/anchors.md A3/§3.2: NPU fp16 GEMV weight stream on 3 cores 30.9 GB/s of 33.8 nominal]
CORE_STREAM_BYTES_PER_CYCLE = 10.9
# [docs/anchors.md §3.2: NPU fp16 GEMV weight stream on 1 core 10.9 GB/s at the 1 GHz NPU clock
#  (allbilly/qwen3.c)]. GUESS: a core's DMA rate scales with the NPU clock.

VENDOR_NPU_MHZ = 1000
# the NPU clock under the vendor driver [docs/anchors.md §3.1]; mainline rocket boots at 200 MHz


@dataclass(frozen=True)
class NpuClock:
    """The NPU clock a modeled time is priced at and where that figure comes from (the
    driver's report, check-rig's reading, the simulated kernel's own clock, or an assumption),
    so that output naming a modeled time can say which clock it is at."""

    mhz: float
    source: str

    def __post_init__(self) -> None:
        if self.mhz <= 0:
            raise ValueError(f"an NPU clock must be positive, not {self.mhz} MHz ({self.source})")

    def __str__(self) -> str:
        return f"{self.mhz:g} MHz ({self.source})"


VENDOR_CLOCK = NpuClock(VENDOR_NPU_MHZ, "assumed: the vendor driver's clock")


# --- fitted and derived overheads -----------------------------------------------------
OVERLAP_PENALTY = 0.5
# FIT: the share of the shorter of compute and memory that does not overlap the longer one.
# Fitted (0.3..0.7 scanned in steps of 0.1) to ANCHORS: 0.5 minimises the worst error,
# which is 25% (the 3-core 1739 GFLOP/s GEMM, under-predicted by the model).
TASK_OVERHEAD_CYCLES = 2000
# GUESS: regcmd fetch of ~110 words plus CNA/DPU pipeline fill and drain, ~2 us at 1 GHz.
# No published figure; the anchors have few tasks and move by < 1% if it is set to 0.


@dataclass(frozen=True)
class SubmitProfile:
    """Fixed cost of one submit on a given software path (ioctl, IRQ, wake-up, runtime)."""

    name: str
    per_submit_s: float
    source: str


OWN_DRIVER = SubmitProfile(
    "own-regcmd",
    79e-6,
    "derived from docs/anchors.md A6/§3.5 (allbilly/qwen3.c): Qwen3-0.6B fp16 decode 20.85 tok/s "
    "= 48.0 ms/token at 80.3% of a 30.9 GB/s stream (38.5 ms of streaming); the other "
    "9.4 ms over 119 submits/token is 79 us per submit (host work included: an upper bound)",
)
RKNN_RUNTIME = SubmitProfile(
    "librknnrt rknn_matmul_run",
    250e-6,
    "FIT: intercept of the prototype's board GEMV times [docs/history.md §7] (M=1, K=2048, N=2048/5504/32000 at "
    "1.04/2.50/12.0 ms) against weight bytes; one call of the closed runtime",
)


ROCKET_DOMAIN_SWITCH_S = 20e-6
# GUESS, per rocket job: rocket_job_run attaches the submitting file's IOMMU domain to the core's
# IOMMU group and detaches it when the job ends [docs/npu-programming.md "What the drivers really
# do"]; no board has measured it. 20 us stands for two IOMMU enables/disables with TLB zaps and
# the runtime-PM get/put around them. Replace it with a board's figure.


@dataclass(frozen=True)
class TaskWork:
    """What one hardware task does, as the cost model needs it.

    ``m`` output pixels (matmul rows), ``k`` input channels as fetched (padded to 32),
    ``n`` kernels (output channels), ``in_dtype`` "fp16" | "int8", ``out_bytes`` per output
    element (4 for fp32/int32, 2 for fp16)."""

    core: int
    m: int
    k: int
    n: int
    in_dtype: str
    out_bytes: int

    def macs_padded(self) -> int:
        group = KERNEL_GROUP[self.in_dtype]
        n_pad = align_up(self.n, group)
        k_pad = align_up(self.k, K_ALIGN)
        return align_up(self.m, M_ATOM) * k_pad * n_pad

    def bytes_moved(self) -> int:
        b = IN_BYTES[self.in_dtype]
        k_pad = align_up(self.k, K_ALIGN)
        return k_pad * self.n * b + self.m * k_pad * b + self.m * self.n * self.out_bytes


@dataclass(frozen=True)
class Workload:
    """A Program-like description: the tasks of one submit (any cores)."""

    tasks: tuple[TaskWork, ...]
    submits: int = 1


@dataclass(frozen=True)
class ModeledTime:
    """Modeled seconds. ``total_s`` is not the sum of the parts: per task, compute and
    memory overlap (see the module docstring). ``compute_s`` and ``memory_s`` are those of
    the slowest core; ``overhead_s`` is that core's task overheads plus the submit cost."""

    total_s: float
    compute_s: float
    memory_s: float
    overhead_s: float
    label: str = field(default="modeled", init=False)

    def gflops(self, flops: float) -> float:
        return flops / self.total_s / 1e9

    def __str__(self) -> str:
        return (f"{self.total_s * 1e3:.3f} ms (modeled: compute {self.compute_s * 1e3:.3f} ms, "
                f"memory {self.memory_s * 1e3:.3f} ms, overhead {self.overhead_s * 1e3:.3f} ms)")


def dram_bandwidth(dram_mhz: float) -> float:
    """Bytes/s the NPU can stream from DRAM at a DRAM clock (nominal x NPU efficiency)."""
    return dram_mhz * 1e6 * DRAM_TRANSFERS_PER_CLOCK * DRAM_BYTES_PER_TRANSFER * NPU_DRAM_EFFICIENCY


def modeled_time(program: Any, *, npu_mhz: float = VENDOR_NPU_MHZ, dram_mhz: float = 2112,
                 profile: SubmitProfile = OWN_DRIVER) -> ModeledTime:
    """Modeled time of a ``compiler.Program`` (decoded from its register words) or of a
    ``Workload``. ``npu_mhz``: NPU clock (1000 under the vendor driver, 200/600 under rocket
    [docs/anchors.md §3.1]); ``dram_mhz``: DRAM clock (2112 max, 528 when the DMC governor parks it
    [docs/anchors.md §3.2 pitfalls])."""
    if npu_mhz <= 0 or dram_mhz <= 0:
        raise ValueError(f"clocks must be positive (npu_mhz={npu_mhz}, dram_mhz={dram_mhz})")
    work = program if isinstance(program, Workload) else workload_from_program(program)
    if not work.tasks:
        raise ValueError("a program without tasks has no modeled time")
    cores = sorted({t.core for t in work.tasks})
    per_core: dict[int, list[float]] = {c: [0.0, 0.0, 0.0, 0.0] for c in cores}  # total, comp, mem, ovh
    for task in work.tasks:
        parts = _task_parts(task, npu_mhz, dram_mhz, len(cores))
        acc = per_core[task.core]
        for i, x in enumerate(parts):
            acc[i] += x
    total, compute_s, memory_s, overhead_s = max(per_core.values(), key=lambda a: a[0])
    submit_s = profile.per_submit_s * work.submits
    return ModeledTime(total + submit_s, compute_s, memory_s, overhead_s + submit_s)


def rocket_time(program: Any, *, files: int, npu_mhz: float, dram_mhz: float = 2112,
                profile: SubmitProfile = OWN_DRIVER) -> ModeledTime:
    """Modeled time of a program's jobs under mainline rocket, where one open file's jobs run
    one after another on one core [docs/npu-programming.md "What the drivers really do"].
    ``files=1``: every core's share is a job of the one file, so the shares run in turn (their
    sum). ``files`` = the cores used: core i's share is submitted by file i, so the shares run
    side by side (``rocket_files_time``)."""
    work = program if isinstance(program, Workload) else workload_from_program(program)
    if not work.tasks:
        raise ValueError("a program without tasks has no modeled time")
    cores = sorted({t.core for t in work.tasks})
    if files not in (1, len(cores)):
        raise ValueError(f"rocket runs a program from one file or one file per core used ({len(cores)}), "
                         f"not {files}")
    if files == 1:
        return rocket_files_time([work], npu_mhz=npu_mhz, dram_mhz=dram_mhz, profile=profile)
    return rocket_files_time([Workload(tuple(t for t in work.tasks if t.core == c), work.submits) for c in cores],
                             npu_mhz=npu_mhz, dram_mhz=dram_mhz, profile=profile)


def rocket_files_time(files: Sequence[Workload], *, npu_mhz: float, dram_mhz: float = 2112,
                      profile: SubmitProfile = OWN_DRIVER) -> ModeledTime:
    """Modeled time of jobs submitted at once from several open files under mainline rocket,
    ``files[i]`` the work of file i: each file's tasks run in turn on its one core (their sum,
    whatever cores the tasks name), the files side by side on their own cores, sharing the
    DRAM stream (the slowest file). Every job pays ``ROCKET_DOMAIN_SWITCH_S`` (a guess; a
    SUBMIT holds one job per core its tasks name) and every file's SUBMIT and wait the profile's per-submit cost
    (all added: an upper bound, the waits overlap)."""
    if not files or not all(w.tasks for w in files):
        raise ValueError("every file needs tasks to have a modeled time")
    per_file = []   # total, compute, memory, overhead
    for work in files:
        acc = [0.0, 0.0, 0.0, 0.0]
        for task in work.tasks:
            for i, x in enumerate(_task_parts(task, npu_mhz, dram_mhz, len(files))):
                acc[i] += x
        switches = work.submits * len({t.core for t in work.tasks}) * ROCKET_DOMAIN_SWITCH_S   # its jobs
        acc[0] += switches
        acc[3] += switches
        per_file.append(acc)
    submit_s = profile.per_submit_s * sum(w.submits for w in files)
    total, compute_s, memory_s, overhead_s = max(per_file, key=lambda a: a[0])
    return ModeledTime(total + submit_s, compute_s, memory_s, overhead_s + submit_s)


def driver_time(program: Any, *, abi: str, npu_mhz: float) -> ModeledTime:
    """Modeled time of a program submitted from one open file of driver ``abi``: the vendor
    driver runs its cores side by side (``modeled_time``), rocket one file's jobs in turn
    (``rocket_time`` with ``files=1``)."""
    if abi == "rocket":
        return rocket_time(program, files=1, npu_mhz=npu_mhz)
    return modeled_time(program, npu_mhz=npu_mhz)


def _task_parts(task: TaskWork, npu_mhz: float, dram_mhz: float, cores_in_job: int) -> tuple[float, ...]:
    """(total, compute, memory, overhead) seconds of one task, as the module doc says."""
    f_npu = npu_mhz * 1e6
    per_core_bw = min(CORE_STREAM_BYTES_PER_CYCLE * f_npu, dram_bandwidth(dram_mhz) / cores_in_job)
    overhead = TASK_OVERHEAD_CYCLES / f_npu
    compute = task.macs_padded() / MACS_PER_CYCLE_PER_CORE[task.in_dtype] / f_npu
    memory = task.bytes_moved() / per_core_bw
    return max(compute, memory) + OVERLAP_PENALTY * min(compute, memory) + overhead, compute, memory, overhead


def task_seconds(task: TaskWork, *, npu_mhz: float, dram_mhz: float = 2112, cores_in_job: int = 1) -> float:
    """Modeled seconds one task keeps its core busy (no submit cost): what a driver's job
    timeout counts, summed over the tasks of a job."""
    return _task_parts(task, npu_mhz, dram_mhz, cores_in_job)[0]


def vendor_style_workload(M: int, K: int, N: int, *, dtype: str = "fp16", out_bytes: int = 4,
                          cores: int = 1) -> Workload:
    """The tasks a run of ``M x K x N`` is split into by the documented rules, for shapes
    measured on other software stacks (the anchors) and before a real Program exists:
    N split evenly over ``cores``; per core, N tiles of <= 8176 kernels (DPU channel fields
    are 13 bits; [AB] splits N=8192 as 8144+48 [docs/npu-programming.md §9]); M tiles whose
    input fits 11 of the 12 CBUF banks [docs/npu-programming.md §9]; K segments of <= 8192
    (RK3588 splits B at 8192 [docs/rknn-toolkit.md §4.4])."""
    if min(M, K, N) < 1 or not 1 <= cores <= 3:
        raise ValueError(f"bad shape or cores: M={M} K={K} N={N} cores={cores}")
    b = IN_BYTES[dtype]
    k_segments = ceil_div(K, 8192)
    k_seg = ceil_div(K, k_segments)
    k_pad = align_up(k_seg, K_ALIGN)
    m_tile = min(2047, (11 * 32768) // (k_pad * b))  # DATAIN_HEIGHT is 11 bits [§9]
    n_per_core = ceil_div(N, cores)
    tasks = []
    for core in range(cores):
        n_core = min(N, (core + 1) * n_per_core) - core * n_per_core
        if n_core <= 0:
            continue
        n_tiles = ceil_div(n_core, 8176)
        n_tile = ceil_div(n_core, n_tiles)
        for _ in range(n_tiles * k_segments):
            for m0 in range(0, M, m_tile):
                tasks.append(TaskWork(core, min(m_tile, M - m0), k_pad, n_tile, dtype, out_bytes))
    return Workload(tuple(tasks))


# --- Program decoding -----------------------------------------------------------------
_OUT_BYTES = {"int8": 1, "fp16": 2, "int32": 4, "fp32": 4}
_TASK_REGISTERS = ("CNA_CONV_CON1", "CNA_DATA_SIZE0", "CNA_DATA_SIZE1", "CNA_WEIGHT_SIZE2",
                   "DPU_DATA_FORMAT")


def workload_from_program(program: Any) -> Workload:
    """Read each task's shape back from its register words (decoded with ``hw``, as the
    simulator does), so the model prices what the program really asks the NPU to do."""
    from ggml_rknpu.hw.limits import CNA_PRECISION, DPU_PRECISION
    from ggml_rknpu.hw.regcmd import decode_word
    from ggml_rknpu.hw.registers import REGISTERS

    by_offset = {REGISTERS[name].offset: REGISTERS[name] for name in _TASK_REGISTERS}
    in_names = {code: name for name, code in CNA_PRECISION.items()}
    out_names = {code: name for name, code in DPU_PRECISION.items()}
    tasks = []
    for task in program.tasks:
        regs: dict[str, dict[str, int]] = {}
        for word in program.words[task.word_offset: task.word_offset + task.body_words]:
            _target, value, offset = decode_word(int(word))
            if offset in by_offset:
                regs[by_offset[offset].name] = by_offset[offset].decode(value)
        missing = set(_TASK_REGISTERS) - set(regs)
        if missing:
            raise ValueError(f"task at word {task.word_offset} does not write {sorted(missing)}; "
                             "the cost model cannot price it")
        in_dtype = in_names.get(regs["CNA_CONV_CON1"]["IN_PRECISION"])
        out_dtype = out_names.get(regs["DPU_DATA_FORMAT"]["OUT_PRECISION"])
        if in_dtype not in MACS_PER_CYCLE_PER_CORE or out_dtype not in _OUT_BYTES:
            raise ValueError(f"task at word {task.word_offset}: no MAC rate known for "
                             f"{in_dtype} -> {out_dtype}")
        size0 = regs["CNA_DATA_SIZE0"]
        tasks.append(TaskWork(
            core=task.core,
            m=size0["DATAIN_HEIGHT"] * max(1, size0["DATAIN_WIDTH"]),
            k=regs["CNA_DATA_SIZE1"]["DATAIN_CHANNEL"],
            n=regs["CNA_WEIGHT_SIZE2"]["WEIGHT_KERNELS"],
            in_dtype=in_dtype,
            out_bytes=_OUT_BYTES[out_dtype],
        ))
    return Workload(tuple(tasks), submits=getattr(program, "n_submits", 1))


def total_bytes(tasks: Iterable[TaskWork]) -> int:
    return sum(t.bytes_moved() for t in tasks)
