"""Per-core register state with the two ping-pong register groups, and the per-task view that
flags reads of registers the task did not write.

Model (TRM ``*_S_POINTER`` text [docs/npu-programming.md §2]; inferences marked): every
block has two shadow groups for its registers from OPERATION_ENABLE up (S_STATUS and
S_POINTER are not shadowed); with POINTER_PP_EN a block's group toggles after every task
that enables it, else group ``S_POINTER.POINTER`` is used; writes and execution use the same
group (every stream writes 0xE, which moves pointer and executer together: an inference);
a ``*_PP_CLEAR`` bit resets to group 0. Invariant: a register a task did not write keeps its
group's old value, so ``TaskView`` refuses such reads and the hazard is loud."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import lru_cache

from ggml_rknpu.hw.registers import BY_OFFSET, REGISTERS, Block, block_of_offset
from ggml_rknpu.sim.validate import SYMPTOM_STALE, TaskRefused, Violation

PP_BLOCKS = (Block.CNA, Block.CORE, Block.DPU, Block.DPU_RDMA, Block.PPU, Block.PPU_RDMA)
_S_POINTER = REGISTERS["CNA_S_POINTER"]          # same field layout in every block [registers.xml]
S_POINTER_OFFSET = 0x4                          # block base + 0x4 [registers.xml]


@lru_cache(maxsize=256)
def _pointer_fields(value: int) -> dict[str, int]:
    """S_POINTER fields of a value (a handful of distinct values per program; read-only)."""
    return _S_POINTER.decode(value)


@dataclass
class BlockPointer:
    """One block's S_POINTER state."""

    value: int = 0        # last S_POINTER write
    group: int = 0        # group the current task writes to and executes from

    def write(self, value: int) -> None:
        fields = _pointer_fields(value)
        self.value = value
        if fields["POINTER_PP_CLEAR"] or fields["EXECUTER_PP_CLEAR"]:
            self.group = 0
        elif not fields["POINTER_PP_EN"]:
            self.group = fields["POINTER"]

    @property
    def pingpong(self) -> bool:
        return bool(_pointer_fields(self.value)["POINTER_PP_EN"])

    def task_done(self) -> None:
        if self.pingpong:
            self.group ^= 1


@dataclass
class RegisterFile:
    """All shadowed registers of one core: ``values[g][offset]`` is what group g holds,
    ``writers[g][offset]`` the task that wrote it (two dicts, so a replay is two C-level
    ``update`` calls per block)."""

    values: tuple[dict[int, int], dict[int, int]] = field(default_factory=lambda: ({}, {}))
    writers: tuple[dict[int, int], dict[int, int]] = field(default_factory=lambda: ({}, {}))
    pointers: dict[Block, BlockPointer] = field(
        default_factory=lambda: {b: BlockPointer() for b in PP_BLOCKS})
    task_index: int = 0
    written: set[int] = field(default_factory=set)    # offsets written in the current task

    def write(self, offset: int, value: int) -> None:
        reg = BY_OFFSET.get(offset)
        block = reg.block if reg is not None else block_of_offset(offset)
        if (offset & 0xFFF) == S_POINTER_OFFSET and block in self.pointers:
            self.pointers[block].write(value)
            self.written.add(offset)
            return
        group = self.pointers[block].group if block in self.pointers else 0
        self.values[group][offset] = value
        self.writers[group][offset] = self.task_index
        self.written.add(offset)

    def begin_task(self, task_index: int) -> None:
        self.task_index = task_index
        self.written = set()

    def replay(self, task_index: int, pointer_writes: tuple[tuple[int, int], ...],
               block_writes: tuple[tuple[Block, dict[int, int]], ...]) -> None:
        """The writes of a task decoded before: its S_POINTER writes in order, then its
        other writes per block. The same state as ``write`` one by one, given that no
        block's S_POINTER write followed a write to that block's registers."""
        for offset, value in pointer_writes:
            self.write(offset, value)
        for block, writes in block_writes:
            group = self.pointers[block].group if block in self.pointers else 0
            self.values[group].update(writes)
            self.writers[group].update(dict.fromkeys(writes, task_index))
            self.written.update(writes)

    def end_task(self, enabled_blocks: AbstractSet[Block]) -> None:
        for block in enabled_blocks:
            if block in self.pointers:
                self.pointers[block].task_done()

    def view(self, task_index: int) -> TaskView:
        return TaskView(self, task_index)


class TaskView:
    """Register reads for one executing task; a read of a register the task did not write
    refuses the task (rule 'unwritten-register')."""

    def __init__(self, regfile: RegisterFile, task_index: int) -> None:
        self._rf = regfile
        self.task_index = task_index
        self.reads: list[str] = []

    def value(self, name: str) -> int:
        reg = REGISTERS[name]
        offset = reg.offset
        self.reads.append(name)
        block = reg.block
        group = self._rf.pointers[block].group if block in self._rf.pointers else 0
        if offset not in self._rf.written:
            stale = self._rf.values[group].get(offset)
            if stale is None:
                detail = "never written since reset"
            else:
                detail = (f"register group {group} still holds 0x{stale:08X} from task "
                          f"{self._rf.writers[group][offset]} (ping-pong inheritance)")
            raise TaskRefused(Violation(
                "unwritten-register",
                f"the task reads {name} (0x{offset:04X}) but does not write it; {detail}. "
                "Rewrite the full register set in every task [docs/npu-programming.md §2]",
                name, stale, self.task_index, SYMPTOM_STALE))
        return self._rf.values[group][offset]


def register_name(offset: int) -> str:
    reg = BY_OFFSET.get(offset)
    return reg.name if reg else f"0x{offset:04X}"
