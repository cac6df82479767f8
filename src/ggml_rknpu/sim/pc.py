"""The PC ("register file fetch unit"): fetches a task's regcmd words from memory, applies
them to the register groups, starts the enabled blocks on the op-enable word, follows the
tail to the next task, and stops after TASK_NUMBER tasks [docs/npu-programming.md §2, §3, §11].

Invariants: a fetch outside mapped memory is a DMA read error (raw-status bit 12); a task
with no op-enable idles the PC with no interrupt; INT_STATUS shows completion only once all
TASK_NUMBER tasks completed; a task is decoded once (``DecodeCache``, keyed by its fetched
bytes) only if it ran without a refusal and its decode cannot depend on an earlier task, and
a replay still fetches, writes every register and checks every address. The choices and the
inferences they rest on: docs/decisions.md "sim/pc.py"; the cache: docs/simulator.md."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cache
from typing import NoReturn

import numpy as np

from ggml_rknpu.hw.describe import describe_word
from ggml_rknpu.hw.regcmd import BLOCK_OF_TARGET, OP_ENABLE_OFFSET, OpEnable, Target, decode_word, words_for_amount
from ggml_rknpu.hw.registers import BY_OFFSET, REGISTERS, Block, block_of_offset
from ggml_rknpu.sim.conv import ConvTask, DmaRead, DmaWrite, decode_conv
from ggml_rknpu.sim.execute import BulkConv, execute_conv
from ggml_rknpu.sim.gemm import GemmFn, multiply
from ggml_rknpu.sim.memory import DeviceMemory, DmaFault, note_device_write
from ggml_rknpu.sim.operands import OperandCache
from ggml_rknpu.sim.ppu import PoolTask, decode_ppu, execute_ppu
from ggml_rknpu.sim.regfile import PP_BLOCKS, S_POINTER_OFFSET, RegisterFile
from ggml_rknpu.sim.validate import (
    SYMPTOM_DMA_FAULT,
    SYMPTOM_HANG,
    SYMPTOM_NOT_MODELED,
    SYMPTOM_SILENT,
    NotModeled,
    TaskRefused,
    Violation,
    check_reserved,
)

_INT = REGISTERS["PC_INTERRUPT_RAW_STATUS"]
DMA_READ_ERROR = _INT.field("DMA_READ_ERROR").mask        # bit 12 [§3]
DMA_WRITE_ERROR = _INT.field("DMA_WRITE_ERROR").mask      # bit 13 [§3]
_PC_BASE = REGISTERS["PC_BASE_ADDRESS"]
_PC_AMOUNTS = REGISTERS["PC_REGISTER_AMOUNTS"]
_WORD_BYTES = 8

# The block whose completion interrupt ends a task of a given op-enable mask [§3: int_mask
# 0x300 for DPU-terminated tasks, 0xC00 for PPU; capture pw_c256_h14 task table].
_LAST_BLOCK_INTERRUPT = ((OpEnable.PPU, "PPU"), (OpEnable.DPU, "DPU"), (OpEnable.CORE, "CORE"))
CONV_PIPELINE = OpEnable.CNA | OpEnable.CORE | OpEnable.DPU


def interrupt_bit(enable: int, task_in_run: int) -> int:
    return _interrupt_bit(enable, task_in_run % 2)


@cache
def _interrupt_bit(enable: int, group: int) -> int:
    for flag, name in _LAST_BLOCK_INTERRUPT:
        if enable & flag:
            return _INT.field(f"{name}_{group}").mask
    return 0


@dataclass
class TaskRecord:
    """What the PC saw and ran for one task (the simulator's trace)."""

    index: int
    regcmd_addr: int
    fetched_words: int
    enable_mask: int | None = None
    conv: ConvTask | None = None
    pool: PoolTask | None = None
    writes: dict[int, int] = field(default_factory=dict)   # offset -> value written


@dataclass(frozen=True)
class DecodedTask:
    """A task's words, decoded and validated: everything its replay needs."""

    writes: dict[int, int]                        # offset -> value, as TaskRecord.writes
    pointer_writes: tuple[tuple[int, int], ...]   # in-stream S_POINTER writes, in order
    block_writes: tuple[tuple[Block, dict[int, int]], ...]   # other register-file writes
    next_base: int | None
    next_amount: int | None
    enable: int
    conv: ConvTask | None
    pool: PoolTask | None


class DecodeCache:
    """Decoded tasks by fetched regcmd bytes, least recently used beyond ``max_entries``."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, DecodedTask] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, words: bytes) -> DecodedTask | None:
        task = self._entries.get(words)
        if task is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(words)
        return task

    def put(self, words: bytes, task: DecodedTask) -> None:
        self._entries[words] = task
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


@dataclass
class RunState:
    """Per-core PC registers as the MMIO window shows them."""

    base_address: int = 0
    register_amounts: int = 0
    int_mask: int = 0
    raw_status: int = 0
    task_con: int = 0
    dma_base: int = 0
    task_status: int = 0
    finished: bool = False      # all TASK_NUMBER tasks of the last run completed

    @property
    def int_status(self) -> int:
        visible = self.raw_status if self.finished else self.raw_status & (DMA_READ_ERROR | DMA_WRITE_ERROR)
        return visible & self.int_mask


@dataclass
class RunResult:
    completed_tasks: int = 0
    merged_tasks: int = 0       # tasks that ran inside another task's bulk execution
    diagnostics: list[str] = field(default_factory=list)
    records: list[TaskRecord] = field(default_factory=list)


@cache
def _enabled_blocks(mask: int) -> frozenset[Block]:
    names = {OpEnable.CNA: Block.CNA, OpEnable.CORE: Block.CORE, OpEnable.DPU: Block.DPU,
             OpEnable.DPU_RDMA: Block.DPU_RDMA, OpEnable.PPU: Block.PPU,
             OpEnable.PPU_RDMA: Block.PPU_RDMA}
    return frozenset(b for flag, b in names.items() if mask & flag)


def _decoded(rec: TaskRecord, ordered: list[tuple[int, int]], next_base: int | None,
             next_amount: int | None) -> DecodedTask | None:
    """What a replay of ``rec``'s words needs, or None when the task may not be replayed
    from a cache (an S_POINTER write after a register write of its block)."""
    pointers: list[tuple[int, int]] = []
    per_block: dict[Block, dict[int, int]] = {}
    for offset, value in ordered:
        block = BY_OFFSET[offset].block
        if (offset & 0xFFF) == S_POINTER_OFFSET and block in PP_BLOCKS:   # as RegisterFile.write
            if block in per_block:
                return None
            pointers.append((offset, value))
        else:
            per_block.setdefault(block, {})[offset] = value
    assert rec.enable_mask is not None
    return DecodedTask(dict(rec.writes), tuple(pointers), tuple(per_block.items()), next_base,
                       next_amount, rec.enable_mask, rec.conv, rec.pool)


class ProgramCounter:
    """Runs one core's program; owns nothing but what a run needs."""

    def __init__(self, core: int, memory: DeviceMemory, regs: RegisterFile, state: RunState,
                 operands: OperandCache | None = None, decoded: DecodeCache | None = None,
                 bulk: bool = False, gemm: GemmFn = multiply) -> None:
        self.core, self.memory, self.regs, self.state = core, memory, regs, state
        self.cache = operands if operands is not None else OperandCache()
        self.decoded = decoded
        self.gemm = gemm
        self.bulk = BulkConv(memory, self.cache, self.gemm) if bulk else None
        self.cbuf_weights: tuple[ConvTask, int] | None = None   # last conv task's weights, task no.
        self.cbuf_data: tuple[ConvTask, int] | None = None

    def run(self) -> RunResult:
        result = RunResult()
        self.state.finished = False
        try:
            self._run(result)
        except TaskRefused as exc:
            result.diagnostics.append(exc.violation.describe())
        except NotModeled as exc:
            task = max(len(result.records) - 1, 0)
            result.diagnostics.append(f"task {task}: {exc} ({SYMPTOM_NOT_MODELED})")
        except (DmaRead, DmaFault) as exc:
            bit = DMA_WRITE_ERROR if isinstance(exc, DmaWrite) else DMA_READ_ERROR
            self.state.raw_status |= bit
            kind = "write" if bit == DMA_WRITE_ERROR else "read"
            task = max(len(result.records) - 1, 0)
            result.diagnostics.append(
                f"task {task}: DMA {kind} fault (raw status 0x{bit:X}) {exc}; the address "
                f"register names which buffer to map or fix ({SYMPTOM_DMA_FAULT})")
        finally:
            if self.bulk is not None:
                self.bulk.flush()   # cannot fail: see BulkConv
                result.merged_tasks = self.bulk.tasks_merged
            self.cache.end_run()
        self._final_interrupt_check(result)
        return result

    def _refuse(self, task: int, rule: str, message: str, register: str | None = None,
                value: int | None = None, symptom: str = SYMPTOM_HANG) -> NoReturn:
        raise TaskRefused(Violation(rule, message, register, value, task, symptom))

    def _run(self, result: RunResult) -> None:
        st = self.state
        if _PC_BASE.field("PC_SEL").extract(st.base_address):
            self._refuse(0, "pc-mode", "PC_BASE_ADDRESS.PC_SEL=1 (slave mode) at OP_EN: the PC "
                         "does not fetch; write the regcmd DMA address with bit 0 clear [§3]",
                         "PC_BASE_ADDRESS", st.base_address)
        n_tasks = REGISTERS["PC_TASK_CON"].field("TASK_NUMBER").extract(st.task_con)
        if n_tasks == 1:
            self.bulk = None      # nothing to merge with: execute at once, skip the deferral
        if n_tasks == 0:
            self._refuse(0, "task-number", "PC_TASK_CON.TASK_NUMBER=0: nothing to run, no "
                         "interrupt will come", "PC_TASK_CON", st.task_con)
        if st.dma_base:
            raise NotModeled(f"PC_TASK_DMA_BASE_ADDR=0x{st.dma_base:08X} (both kernels write 0 [§3])")
        addr = _PC_BASE.field("PC_SOURCE_ADDR").extract(st.base_address) * 16
        amount = _PC_AMOUNTS.field("PC_DATA_AMOUNT").extract(st.register_amounts)
        for t in range(n_tasks):
            rec = TaskRecord(t, addr, words_for_amount(amount))
            result.records.append(rec)
            next_base, next_amount = self._run_task(t, rec)
            result.completed_tasks = t + 1
            st.task_status += 1       # counts until TASK_CON.TASK_COUNT_CLEAR [TRM pc_task_con]
            if t == n_tasks - 1:
                st.finished = True
                break
            if not next_base or next_amount is None:
                self._refuse(t, "chain-ends", f"TASK_NUMBER={n_tasks} but task {t}'s tail has "
                             f"PC_BASE_ADDRESS={'none' if next_base is None else hex(next_base)}"
                             f", PC_REGISTER_AMOUNTS={next_amount}: the PC has no task {t + 1} "
                             "to fetch (tail missing, or TASK_NUMBER too large)",
                             "PC_TASK_CON", st.task_con)
            addr = _PC_BASE.field("PC_SOURCE_ADDR").extract(next_base) * 16
            amount = _PC_AMOUNTS.field("PC_DATA_AMOUNT").extract(next_amount)

    def _fetch(self, t: int, addr: int, n_words: int) -> bytes:
        try:
            raw = self.memory.view(addr, n_words * _WORD_BYTES)
        except DmaFault as fault:
            raise DmaRead(f"task {t}: regcmd fetch of {n_words} words", fault) from None
        return raw.tobytes()

    def _run_task(self, t: int, rec: TaskRecord) -> tuple[int | None, int | None]:
        if self.bulk is not None and self.bulk.writes_into(rec.regcmd_addr,
                                                           rec.fetched_words * _WORD_BYTES):
            self.bulk.flush()
        raw = self._fetch(t, rec.regcmd_addr, rec.fetched_words)
        self.regs.begin_task(t)
        cached = self.decoded.get(raw) if self.decoded is not None else None
        if cached is not None:
            return self._replay(t, rec, cached)
        words = np.frombuffer(raw, dtype="<u8")
        ordered: list[tuple[int, int]] = []      # register-file writes, in stream order
        armed = False
        enable: int | None = None
        next_base: int | None = None
        next_amount: int | None = None
        for i, word in enumerate(words.tolist()):
            if word == 0:
                continue
            target, value, offset = decode_word(word)

            def where(i: int = i, word: int = word) -> str:   # built only for a diagnostic
                return (f"word {i} at 0x{rec.regcmd_addr + i * _WORD_BYTES:08X} "
                        f"(0x{word:016X}: {describe_word(word)})")
            if target == Target.MARKER:
                armed = True
            elif target == Target.OP_ENABLE:
                if offset != OP_ENABLE_OFFSET:
                    self._refuse(t, "op-enable", f"{where()}: op-enable word writes register "
                                 f"0x{offset:04X}, not 0x{OP_ENABLE_OFFSET:04X} [§2]")
                if not armed:
                    self._refuse(t, "missing-marker", f"{where()}: op-enable without the "
                                 "0x0041_0000_0000_0000 marker word before it [TRM: 'before "
                                 "op_en, 64'h0041_xxxx must be set'; §2 tail word 2]")
                enable = value
                break
            else:
                block = BLOCK_OF_TARGET.get(target)
                if block is None:
                    self._refuse(t, "unknown-target", f"{where()}: target 0x{target:04X} is none "
                                 "of the block targets 0x0101..0x8001, 0x0041, 0x0081 [§2]")
                reg = BY_OFFSET.get(offset)
                if reg is None:
                    self._refuse(t, "unknown-register", f"{where()}: no known register at offset "
                                 f"0x{offset:04X} [registers.xml]")
                if reg.block != block:
                    self._refuse(t, "target-block", f"{where()}: target 0x{target:04X} "
                                 f"({block.name}) writes 0x{offset:04X}, a "
                                 f"{block_of_offset(offset).name} register [§11.1]")
                name = reg.name
                try:
                    check_reserved(name, value)
                except TaskRefused as exc:
                    raise TaskRefused(Violation(**{**exc.violation.__dict__, "task": t})) from None
                rec.writes[offset] = value
                if block == Block.PC:
                    if offset == _PC_BASE.offset:
                        next_base = value
                    elif offset == _PC_AMOUNTS.offset:
                        next_amount = value
                    else:
                        raise NotModeled(f"{where()}: in-stream write of PC register {name}")
                    setattr(self.state, "base_address" if offset == _PC_BASE.offset
                            else "register_amounts", value)
                else:
                    self.regs.write(offset, value)
                    ordered.append((offset, value))
        if enable is None:
            self._refuse(t, "missing-tail", f"no op-enable word among the {rec.fetched_words} "
                         f"words fetched from 0x{rec.regcmd_addr:08X} (PC_REGISTER_AMOUNTS too "
                         "small, or the task lacks its 4-word tail: BASE, AMOUNTS, 0x0041 "
                         "marker, 0x0081 op-enable [§2])")
        rec.enable_mask = enable
        self._execute(t, rec, enable)
        self._finish_task(t, enable)
        if self.decoded is not None:
            decoded = _decoded(rec, ordered, next_base, next_amount)
            if decoded is not None:
                self.decoded.put(raw, decoded)
        return next_base, next_amount

    def _finish_task(self, t: int, enable: int) -> None:
        self.state.raw_status |= interrupt_bit(enable, t)
        self.regs.end_task(_enabled_blocks(enable))

    def _replay(self, t: int, rec: TaskRecord, task: DecodedTask) -> tuple[int | None, int | None]:
        """A task whose words decoded and validated before: same register-file and PC
        effects as ``_run_task``, then execution through the memory model (which checks
        every address again)."""
        rec.writes = dict(task.writes)
        self.regs.replay(t, task.pointer_writes, task.block_writes)
        if task.next_base is not None:
            self.state.base_address = task.next_base
        if task.next_amount is not None:
            self.state.register_amounts = task.next_amount
        rec.enable_mask, rec.conv, rec.pool = task.enable, task.conv, task.pool
        try:
            if task.conv is not None:
                self._check_reuse(t, task.conv)
                self._execute_conv(task.conv, t)
            else:
                assert task.pool is not None
                self._execute_pool(task.pool)
        except TaskRefused as exc:
            v = exc.violation
            raise TaskRefused(Violation(v.rule, v.message, v.register, v.value, t, v.symptom)) \
                from None
        self._finish_task(t, task.enable)
        return task.next_base, task.next_amount

    def _execute_conv(self, conv: ConvTask, t: int) -> None:
        if self.bulk is not None:
            self.bulk.submit(conv)
        else:
            execute_conv(self.memory, conv, self.cache, self.gemm)
        self.cbuf_weights = (conv, t)
        self.cbuf_data = (conv, t)

    def _execute_pool(self, pool: PoolTask) -> None:
        if self.bulk is not None:
            self.bulk.flush()
        execute_ppu(self.memory, pool)
        self.cache.invalidate(pool.dst_addr, pool.dst_plane_bytes)
        note_device_write(self.memory, pool.dst_addr, pool.dst_plane_bytes)

    def _execute(self, t: int, rec: TaskRecord, enable: int) -> None:
        view = self.regs.view(t)
        try:
            if enable == 0:
                self._refuse(t, "op-enable", "op-enable mask 0 starts no block; no interrupt")
            if enable & CONV_PIPELINE:
                if enable & CONV_PIPELINE != CONV_PIPELINE:
                    self._refuse(t, "op-enable", f"op-enable 0x{enable:02X} starts part of the "
                                 "CNA->CORE->DPU pipeline (conv tasks use 0x0D, 0x1D [§2]): the "
                                 "missing stage never consumes/produces data, no DPU interrupt")
                if enable & (OpEnable.PPU | OpEnable.PPU_RDMA):
                    raise NotModeled(f"op-enable 0x{enable:02X}: conv feeding the PPU")
                rec.conv = decode_conv(view, rdma_enabled=bool(enable & OpEnable.DPU_RDMA))
                self._check_reuse(t, rec.conv)
                self._execute_conv(rec.conv, t)
            elif enable & OpEnable.PPU:
                rec.pool = decode_ppu(view, rdma_enabled=bool(enable & OpEnable.PPU_RDMA))
                self._execute_pool(rec.pool)
            else:
                raise NotModeled(f"op-enable 0x{enable:02X} (DPU/RDMA-only elementwise tasks)")
        except TaskRefused as exc:
            v = exc.violation
            raise TaskRefused(Violation(v.rule, v.message, v.register, v.value, t, v.symptom)) \
                from None

    def _check_reuse(self, t: int, conv: ConvTask) -> None:
        """WEIGHT_REUSE / DATA_REUSE skip the refetch and use what CBUF holds [§7 table; MESA
        sets WEIGHT_REUSE on tasks after the first when the weights are resident, §9;
        capture c64_h56 task 1]. Sound only if the previous conv task of this run left
        exactly these weights / this data resident; otherwise a board would silently
        compute with the old CBUF content (*inference*), so the task is refused."""
        for flag, held, key, resident, what, reg, rule in (
            (conv.weight_reuse, self.cbuf_weights, "weight_key", "weights_resident", "weights",
             "CNA_DCOMP_ADDR0", "weight-reuse"),
            (conv.data_reuse, self.cbuf_data, "data_key", None, "feature data",
             "CNA_FEATURE_DATA_ADDR", "data-reuse"),
        ):
            if not flag:
                continue
            if held is None:
                raise NotModeled(f"{what} reuse in the first conv task of a run (CBUF content "
                                 "across submits)")
            prev, prev_t = held
            cbuf = "CNA_CBUF_CON0"
            if resident is not None and not getattr(prev, resident):
                self._refuse(t, rule, f"CBUF_CON0 reuses the {what} of task {prev_t}, but that "
                             f"task streamed them ({prev.weight_bytes} B > WEIGHT_BANK="
                             f"{prev.weight_banks} banks): CBUF holds only a part", cbuf,
                             symptom=SYMPTOM_SILENT)
            if getattr(prev, key) != getattr(conv, key):
                self._refuse(t, rule, f"CBUF_CON0 reuses the {what} of task {prev_t} "
                             f"({reg}=0x{getattr(prev, key)[0]:08X}), but this task names "
                             f"different {what} ({reg}=0x{getattr(conv, key)[0]:08X}, or "
                             "another size)", cbuf, symptom=SYMPTOM_SILENT)

    def _final_interrupt_check(self, result: RunResult) -> None:
        """Explain a run that ends without a completion interrupt (bad INT_MASK and friends)."""
        st = self.state
        if result.diagnostics:
            return
        masked = st.int_status
        pairs = [3 << (2 * i) for i in range(7)]
        widened = sum(p for p in pairs if masked & p)
        if masked and widened != st.int_mask:
            result.diagnostics.append(
                f"task {result.completed_tasks - 1}: rule 'int-mask' [PC_INTERRUPT_MASK="
                f"0x{st.int_mask:08X}]: the run completed with status 0x{masked:X}, but the "
                "vendor IRQ handler widens the status to whole group pairs "
                f"(0x{widened:X}) and completes the job only if that equals the last task's "
                "int_mask: use a whole group pair pattern such as 0x300 or 0xC00 [§3] (on a "
                "board with the vendor driver: 'invalid irq status', then a timeout)")
        if not masked:
            result.diagnostics.append(
                f"task {result.completed_tasks - 1}: rule 'int-mask' [PC_INTERRUPT_MASK="
                f"0x{st.int_mask:08X}]: all {result.completed_tasks} task(s) ran, but the raw "
                f"status 0x{st.raw_status:X} has no bit inside INT_MASK: the last task's "
                "completion interrupt is masked. Use 0x300 when the last task ends in the DPU, "
                "0xC00 when it ends in the PPU [§3] (on a board: no interrupt, the kernel times "
                "out and resets)")
