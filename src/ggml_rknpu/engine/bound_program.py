"""``BoundProgram``: one compiled matmul program bound to fixed NPU buffers (its register
commands, shares of its bucket's scratch, the weight's B), and the device jobs that run it.

Invariants: regcmd words only ever point at live buffers (``write_words`` re-binds after a
scratch buffer grew); a program's jobs are one per chain, submitted in order; A and C are
inputs of the first (C holds the CPU's canaries). Why: docs/decisions.md "engine/api.py"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_rknpu.compiler.program import Program
from ggml_rknpu.cost.model import ModeledTime, Workload
from ggml_rknpu.engine.canary import Canaries, CanaryCells
from ggml_rknpu.engine.hostpath import ActivationPort, ResultPort
from ggml_rknpu.engine.scratch import ScratchShare
from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.job import BufferRange, HwTask, Job


@dataclass(eq=False)
class BoundProgram:
    """A compiled program bound to shares of its bucket's shared A and C buffers, its own
    regcmd buffer and the weight's B."""

    program: Program
    m: int
    b_addr: int
    modeled: ModeledTime | None
    workload: Workload           # what the cost model prices for it (``cost.model.workload_from_program``)
    a_buf: ScratchShare | None = None
    c_buf: ScratchShare | None = None
    regcmd_buf: Buffer | None = None
    jobs: tuple[Job, ...] = ()   # one per chain of the program, submitted in order
    canaries: Canaries | None = None
    ports: tuple[ActivationPort, ResultPort] | None = None   # engine.hostpath's, over the scratch
    ports_bound_to: tuple[Buffer, Buffer] | None = None      # the (A, C) scratch buffers the ports view
    label: str = ""              # what a timeout names (formatted once, not per submit)
    cells: CanaryCells | None = None    # the canaries bound to the C scratch buffer
    cells_bound_to: Buffer | None = None   # the C scratch buffer they view

    def write_words(self) -> None:
        """Bind the register commands to the current buffers and make them visible to the NPU;
        the job follows (its ranges name the current scratch buffers)."""
        assert self.a_buf is not None and self.c_buf is not None and self.regcmd_buf is not None, \
            "bound before joining its scratch buffers"
        words = self.program.bind(a=self.a_buf.dma_addr, b=self.b_addr, c=self.c_buf.dma_addr,
                                  regcmd=self.regcmd_buf.dma_addr)
        self.regcmd_buf.array(np.uint64)[: len(words)] = words
        self.regcmd_buf.sync_to_device(0, words.nbytes)
        if self.jobs:
            self.jobs = with_ranges(self.jobs, self.a_buf.range(), self.c_buf.range())

    def canary_cells(self) -> CanaryCells:
        """The canaries bound to the current C scratch buffer (re-bound when the shared buffer
        was replaced by a larger one)."""
        assert self.canaries is not None and self.c_buf is not None, "not bound yet"
        cells = self.cells
        if cells is None or self.cells_bound_to is not self.c_buf.scratch.buf:
            cells = self.cells = self.canaries.over(self.c_buf.array(np.uint8))
            self.cells_bound_to = self.c_buf.scratch.buf
        return cells

    def close(self) -> None:
        for share in {id(s.scratch): s for s in (self.a_buf, self.c_buf) if s is not None}.values():
            share.scratch.leave(self)
        if self.regcmd_buf is not None:
            self.regcmd_buf.close()


def program_jobs(program: Program, regcmd_addr: int, n_cores: int, a: BufferRange, c: BufferRange,
                 domain: int = 0) -> tuple[Job, ...]:
    """The device Jobs that run ``program`` (its regcmd words at ``regcmd_addr``, in IOMMU
    domain ``domain``): one per chain, in order. A and C are inputs of the first (C holds the
    CPU's canaries)."""
    return with_ranges(tuple(Job(cores=cores, domain=domain)
                             for cores in program_cores(program, regcmd_addr, n_cores)), a, c)


def program_cores(program: Program, regcmd_addr: int, n_cores: int) -> list[tuple[tuple[HwTask, ...], ...]]:
    """Each chain's tasks per core, in order (the ``cores`` of ``program_jobs``' Jobs)."""
    chains: list[list[list[HwTask]]] = [[[] for _ in range(n_cores)] for _ in range(program.n_submits)]
    for task in program.tasks:
        chains[task.chain][task.core].append(HwTask(
            regcmd_addr=regcmd_addr + task.word_offset * 8, body_words=task.body_words,
            int_mask=task.int_mask, enable_mask=task.enable_mask))
    return [tuple(tuple(t) for t in per_core) for per_core in chains]


def with_ranges(jobs: tuple[Job, ...], a: BufferRange, c: BufferRange) -> tuple[Job, ...]:
    """``jobs`` naming the scratch ranges ``a`` and ``c`` (again, after a scratch buffer grew).
    A and C in one buffer, A first: one input range from A to the end of C (one clean)."""
    if (isinstance(a, BufferRange) and isinstance(c, BufferRange) and a.buffer is c.buffer
            and a.offset + a.size <= c.offset):
        inputs: tuple[BufferRange, ...] = (BufferRange(a.buffer, a.offset, c.offset + c.size - a.offset),)
    else:
        inputs = (a, c)
    return tuple(Job(cores=job.cores, inputs=inputs if i == 0 else (), outputs=(c,), domain=job.domain)
                 for i, job in enumerate(jobs))
