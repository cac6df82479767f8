"""``SimNpu``: the RK3588 NPU's per-core MMIO window in software.

The simulated kernel drives it with the register writes the real drivers issue
[docs/npu-programming.md §3]; writing 1 to PC_OPERATION_ENABLE runs the core's program
synchronously (``pc.ProgramCounter``) until it completes or stops as a board would, and
``diagnostics(core)`` says why. Invariants: this is the witness half of the project, it
decodes words with ``ggml_rknpu.hw`` only and never imports ``ggml_rknpu.compiler``
(tests/sim/test_sim_independence.py); what stays across runs is only what a content check
vouches for. What it adds to the interface the kernel drives: docs/decisions.md "sim/npu.py"."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.registers import REGISTERS, Block, block_of_offset
from ggml_rknpu.sim.gemm import Gemm, multiply
from ggml_rknpu.sim.memory import DeviceMemory
from ggml_rknpu.sim.operands import OperandCache
from ggml_rknpu.sim.pc import DecodeCache, ProgramCounter, RunState, TaskRecord
from ggml_rknpu.sim.regfile import S_POINTER_OFFSET, RegisterFile


def _off(name: str) -> int:
    return REGISTERS[name].offset


OP_ENABLE = _off("PC_OPERATION_ENABLE")
BASE_ADDRESS = _off("PC_BASE_ADDRESS")
REGISTER_AMOUNTS = _off("PC_REGISTER_AMOUNTS")
INT_MASK = _off("PC_INTERRUPT_MASK")
INT_CLEAR = _off("PC_INTERRUPT_CLEAR")
INT_STATUS = _off("PC_INTERRUPT_STATUS")
INT_RAW_STATUS = _off("PC_INTERRUPT_RAW_STATUS")
TASK_CON = _off("PC_TASK_CON")
TASK_DMA_BASE = _off("PC_TASK_DMA_BASE_ADDR")
TASK_STATUS = _off("PC_TASK_STATUS")
VERSION = _off("PC_VERSION")
VERSION_NUM = _off("PC_VERSION_NUM")

# All of the reported version is put in VERSION (guess: how it splits is unknown).
VERSION_VALUE = limits.HW_VERSION
VERSION_NUM_VALUE = 0
_TASK_COUNT_CLEAR = REGISTERS["PC_TASK_CON"].field("TASK_COUNT_CLEAR")
_INT_BITS = REGISTERS["PC_INTERRUPT_CLEAR"].field("RESERVED_0").lo   # 14 status bits [§3]
_INT_ALL = (1 << _INT_BITS) - 1


HOST_THREADS_ENV = "RKNPU_SIM_THREADS"
DEFAULT_HOST_THREADS = 2


def host_threads() -> int:
    """Host threads the simulator may use for one large GEMM: $RKNPU_SIM_THREADS, else 2
    (the dev box's cores; a decode client waits while the server simulates), at most the
    CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    value = os.environ.get(HOST_THREADS_ENV, "")
    try:
        wanted = int(value) if value else DEFAULT_HOST_THREADS
    except ValueError:
        raise ValueError(f"{HOST_THREADS_ENV}={value!r} is not a whole number of threads") from None
    if wanted < 1:
        raise ValueError(f"{HOST_THREADS_ENV}={wanted}: at least 1 thread")
    return min(wanted, cpus)


@dataclass
class _Core:
    state: RunState = field(default_factory=RunState)
    regs: RegisterFile = field(default_factory=RegisterFile)
    diagnostics: list[str] = field(default_factory=list)
    records: list[TaskRecord] = field(default_factory=list)
    completed: int = 0


class SimNpu:
    def __init__(self, memory: DeviceMemory, n_cores: int = limits.N_CORES) -> None:
        self.memory = memory
        self.n_cores = n_cores
        self._cores = [_Core() for _ in range(n_cores)]
        self.operands = OperandCache()
        self.decoded = DecodeCache()
        self.busy_seconds = 0.0
        # True: conv tasks of a run that tile M over one weight block, or N at one row,
        # execute as one (conv.BulkConv), and one-row GEMMs over large weights run in blocks
        # on several host threads (conv.Gemm); False: every task on its own, one BLAS call
        # each: the reference the fast paths are tested against (tests/sim/test_sim_bulk.py).
        self.bulk = True
        self.merged_tasks = 0
        self.gemm = Gemm(host_threads())

    def _core(self, core: int) -> _Core:
        if not 0 <= core < self.n_cores:
            raise ValueError(f"core {core} does not exist (this NPU has {self.n_cores})")
        return self._cores[core]

    def mmio_write(self, core: int, offset: int, value: int) -> None:
        c = self._core(core)
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"MMIO value 0x{value:X} is not 32-bit")
        st = c.state
        if offset == OP_ENABLE:
            if value & 1:
                self._run(c, core)
        elif offset == BASE_ADDRESS:
            st.base_address = value
        elif offset == REGISTER_AMOUNTS:
            st.register_amounts = value
        elif offset == INT_MASK:
            st.int_mask = value & _INT_ALL
        elif offset == INT_CLEAR:
            st.raw_status &= ~value & _INT_ALL
        elif offset == TASK_CON:
            if _TASK_COUNT_CLEAR.extract(value):
                st.task_status = 0
            st.task_con = value
        elif offset == TASK_DMA_BASE:
            st.dma_base = value
        elif (offset & 0xFFF) == S_POINTER_OFFSET and block_of_offset(offset) in (
                Block.CNA, Block.CORE, Block.DPU, Block.DPU_RDMA, Block.PPU, Block.PPU_RDMA):
            c.regs.write(offset, value)   # bit 28 = core index in the kernels' value [§3]
        else:
            raise ValueError(f"SimNpu: MMIO write to 0x{offset:04X} is outside the modeled "
                             "window (PC registers and *_S_POINTER) [§3]")

    def mmio_read(self, core: int, offset: int) -> int:
        st = self._core(core).state
        reads = {
            VERSION: VERSION_VALUE,
            VERSION_NUM: VERSION_NUM_VALUE,
            BASE_ADDRESS: st.base_address,
            REGISTER_AMOUNTS: st.register_amounts,
            INT_MASK: st.int_mask,
            INT_STATUS: st.int_status,
            INT_RAW_STATUS: st.raw_status,
            TASK_CON: st.task_con,
            TASK_DMA_BASE: st.dma_base,
            TASK_STATUS: st.task_status,
        }
        if offset not in reads:
            raise ValueError(f"SimNpu: MMIO read of 0x{offset:04X} is outside the modeled window")
        return reads[offset]

    def soft_reset(self, core: int | None = None) -> None:
        """Registers, pointers and status back to reset values; diagnostics are kept."""
        for i in range(self.n_cores) if core is None else (core,):
            c = self._core(i)
            c.state = RunState()
            c.regs = RegisterFile()

    def diagnostics(self, core: int) -> list[str]:
        return list(self._core(core).diagnostics)

    def executed_tasks(self, core: int) -> int:
        return self._core(core).completed

    def trace(self, core: int) -> list[TaskRecord]:
        return list(self._core(core).records)

    def _run(self, c: _Core, core: int) -> None:
        t0 = time.perf_counter()
        try:
            result = ProgramCounter(core, self.memory, c.regs, c.state, self.operands,
                                    self.decoded, self.bulk,
                                    self.gemm if self.bulk else multiply).run()
        finally:
            self.busy_seconds += time.perf_counter() - t0
        self.merged_tasks += result.merged_tasks
        c.diagnostics = list(result.diagnostics)
        c.records = result.records
        c.completed = result.completed_tasks
