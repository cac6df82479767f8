"""``Program``: the whole regcmd buffer image of a matmul, its task table and the relocations
that bind it to buffer addresses without recompiling.

Invariants: tasks are grouped by core in execution order, each 64-byte aligned, padding
words 0 (a NOP); each task's tail points at the next task of the same core and the last
task of every chain has the (0, 0) tail, so the same words serve both ABIs; no chain is
longer than the envelope allows (``max_chain_tasks``, ``max_job_ms``); submit j runs
chain j of every core. Sources: docs/compiler.md "Program layout and chains"."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggml_rknpu.compiler.emit import ADDRESS_ROLES, buffer_offsets, task_registers
from ggml_rknpu.compiler.layout import a_bytes, b_bytes, c_bytes, partial_dtype
from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.compiler.tiling import KChunk, Tiling
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.envelope import PROVEN, Envelope, by_name
from ggml_rknpu.hw.regcmd import MATMUL_ENABLE, TAIL_WORDS, VALUE_SHIFT, regcmd_word, target_for_offset, task_tail
from ggml_rknpu.hw.registers import REGISTERS

ROLES = ("A", "B", "C", "REGCMD")
_VALUE_CLEAR = np.uint64(0xFFFF_0000_0000_FFFF)   # keeps target and register offset
_TASK_ALIGN_WORDS = limits.REGCMD_TASK_ALIGN // 8
ABIS = ("rknpu", "rocket")


@dataclass(frozen=True)
class Reloc:
    word_index: int
    role: str        # "A" | "B" | "C" | "REGCMD"
    offset: int      # byte offset inside that buffer


@dataclass(frozen=True)
class ProgramTask:
    core: int
    word_offset: int     # first body word inside ``Program.words``
    body_words: int      # excluding the 4-word tail (vendor regcfg_amount)
    enable_mask: int
    int_mask: int
    chain: int = 0       # which submit of the program runs this task (module doc)


@dataclass(frozen=True, eq=False)
class Program:
    words: np.ndarray            # uint64, address fields unbound (hold buffer offsets)
    tasks: tuple[ProgramTask, ...]
    relocs: tuple[Reloc, ...]
    a_bytes: int
    b_bytes: int
    c_bytes: int
    shape: MatmulShape
    k_splits: int
    c_dtype: str = "fp32"
    abi: str = "rknpu"
    k_chunks: tuple[KChunk, ...] = ()
    _reloc_index: np.ndarray = field(init=False, repr=False)
    _reloc_role: np.ndarray = field(init=False, repr=False)
    _reloc_offset: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_reloc_index", np.array([r.word_index for r in self.relocs], dtype=np.int64))
        object.__setattr__(self, "_reloc_role", np.array([ROLES.index(r.role) for r in self.relocs], dtype=np.int64))
        object.__setattr__(self, "_reloc_offset", np.array([r.offset for r in self.relocs], dtype=np.uint64))

    @property
    def regcmd_bytes(self) -> int:
        return int(self.words.size) * 8

    @property
    def cores_used(self) -> int:
        return len({t.core for t in self.tasks})

    def core_tasks(self, core: int) -> tuple[ProgramTask, ...]:
        return tuple(t for t in self.tasks if t.core == core)

    @property
    def n_submits(self) -> int:
        """Submits one run of the program takes: one per chain index (module doc)."""
        return 1 + max((t.chain for t in self.tasks), default=0)

    def bind(self, *, a: int, b: int, c: int, regcmd: int) -> np.ndarray:
        """Copy of ``words`` with every address field set to base + offset (vectorised).
        Raises ValueError for a misaligned base or a buffer reaching past 32 bits."""
        sizes = {"A": self.a_bytes, "B": self.b_bytes, "C": self.c_bytes, "REGCMD": self.regcmd_bytes}
        bases = {"A": a, "B": b, "C": c, "REGCMD": regcmd}
        for role, base in bases.items():
            if base < 0 or base % limits.DATA_ALIGN:
                raise ValueError(f"{role} address 0x{base:X} must be >= 0 and {limits.DATA_ALIGN}-byte aligned")
            if base + sizes[role] > limits.MAX_ADDRESS + 1:
                raise ValueError(f"{role} buffer 0x{base:X}+{sizes[role]} reaches past the 32-bit NPU address space")
        base_arr = np.array([bases[r] for r in ROLES], dtype=np.uint64)
        values = base_arr[self._reloc_role] + self._reloc_offset
        out = self.words.copy()
        idx = self._reloc_index
        out[idx] = (out[idx] & _VALUE_CLEAR) | (values << np.uint64(VALUE_SHIFT))
        return out


def _body_template(shape: MatmulShape, tile, c_dtype: str) -> tuple[np.ndarray, dict[str, int]]:
    """Body words of a task with its address fields, and the position of each address word."""
    regs = task_registers(shape, tile, c_dtype)
    words = np.empty(len(regs), dtype=np.uint64)
    positions: dict[str, int] = {}
    for i, (name, value) in enumerate(regs):
        reg = REGISTERS[name]
        words[i] = regcmd_word(target_for_offset(reg.offset), reg.offset, value)
        if name in ADDRESS_ROLES:
            positions[ADDRESS_ROLES[name]] = i
    return words, positions


def chain_of_tasks(tiling: Tiling, abi: str, envelope: Envelope) -> list[int]:
    """The chain index of every task (module doc): a core's chain ends when the next task
    would make it longer than the envelope's vendor chain, or its rocket job modeled
    longer than ``max_job_ms`` at ``job_model_mhz`` (rocket's boot clock by default)."""
    from ggml_rknpu.cost.model import TaskWork, task_seconds

    shape = tiling.shape
    out_bytes = limits.BYTES[partial_dtype(shape, tiling.k_splits)]
    max_tasks = envelope.max_chain_tasks[shape.dtype] if abi == "rknpu" else limits.MAX_TASKS_PER_SUBMIT
    budget_s = envelope.max_job_ms / 1e3 if abi == "rocket" else float("inf")
    chains, core, chain, count, spent = [], None, 0, 0, 0.0
    for tile in tiling.tasks:
        seconds = task_seconds(TaskWork(tile.core, tile.m, tile.chunk.size, tile.n, shape.dtype, out_bytes),
                               npu_mhz=envelope.job_model_mhz, cores_in_job=tiling.cores_used)
        if tile.core != core:
            core, chain, count, spent = tile.core, 0, 0, 0.0
        elif count >= max_tasks or spent + seconds > budget_s:
            chain, count, spent = chain + 1, 0, 0.0
        chains.append(chain)
        count += 1
        spent += seconds
    return chains


def build_program(tiling: Tiling, abi: str = "rknpu", envelope: Envelope | str = PROVEN) -> Program:
    if abi not in ABIS:
        raise ValueError(f"abi must be one of {ABIS}, got {abi!r}")
    envelope = by_name(envelope)
    chains = chain_of_tasks(tiling, abi, envelope)
    shape = tiling.shape
    c_dtype = partial_dtype(shape, tiling.k_splits)
    sizes = {"A": a_bytes(shape), "B": b_bytes(shape), "C": c_bytes(shape, tiling.k_splits)}
    for role, size in sizes.items():
        if size > limits.MAX_ADDRESS + 1:
            raise ValueError(f"matmul {shape.M}x{shape.K}x{shape.N}: the {role} buffer needs {size} bytes, "
                             "more than the 32-bit NPU address space; split the call")

    bodies: list[np.ndarray] = []
    task_relocs: list[list[tuple[int, str, int]]] = []   # (position in body, role, offset)
    templates: dict[tuple, tuple[np.ndarray, dict[str, int]]] = {}
    for tile in tiling.tasks:
        key = (tile.m, tile.n, tile.chunk.size, tile.data_banks)
        if key not in templates:
            templates[key] = _body_template(shape, tile, c_dtype)
        words, positions = templates[key]
        body = words.copy()
        offs = buffer_offsets(shape, tile, c_dtype)
        for role, pos in positions.items():
            body[pos] = (int(body[pos]) & int(_VALUE_CLEAR)) | (offs[role] << VALUE_SHIFT)
        bodies.append(body)
        task_relocs.append([(p, role, offs[role]) for role, p in positions.items()])

    starts, pos = [], 0
    for body in bodies:
        starts.append(pos)
        pos += align_up(len(body) + TAIL_WORDS, _TASK_ALIGN_WORDS)
    words = np.zeros(pos, dtype=np.uint64)

    tasks: list[ProgramTask] = []
    relocs: list[Reloc] = []
    n = len(tiling.tasks)
    for i, (tile, body, start, body_relocs) in enumerate(zip(tiling.tasks, bodies, starts, task_relocs)):
        words[start: start + len(body)] = body
        relocs.extend(Reloc(start + p, role, offset) for p, role, offset in body_relocs)
        is_last_of_chain = i + 1 == n or tiling.tasks[i + 1].core != tile.core or chains[i + 1] != chains[i]
        tail_at = start + len(body)
        if is_last_of_chain:
            tail = task_tail(0, 0, MATMUL_ENABLE)
        else:
            next_bytes = starts[i + 1] * 8
            tail = task_tail(next_bytes, len(bodies[i + 1]), MATMUL_ENABLE)
            relocs.append(Reloc(tail_at, "REGCMD", next_bytes))
        words[tail_at: tail_at + TAIL_WORDS] = np.array(tail, dtype=np.uint64)
        tasks.append(ProgramTask(tile.core, start, len(body), int(MATMUL_ENABLE), limits.INT_MASK_DPU, chains[i]))

    words.setflags(write=False)
    return Program(
        words=words, tasks=tuple(tasks), relocs=tuple(relocs),
        a_bytes=sizes["A"], b_bytes=sizes["B"], c_bytes=sizes["C"],
        shape=shape, k_splits=tiling.k_splits, c_dtype=c_dtype, abi=abi, k_chunks=tiling.chunks,
    )
