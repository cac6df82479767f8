"""A tiny stand-in for ``sim.npu.SimNpu`` (its MMIO window) so the kernel's submit path can be
tested on its own: it logs every MMIO write, fetches the programmed regcmd range through
``DeviceMemory.view`` (so bad addresses fault like the real model's), follows the task
tails for TASK_NUMBER tasks and raises the configured interrupt bits - or hangs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ggml_rknpu.hw.alignment import ceil_div

PC_BASE, PC_AMOUNTS, PC_INT_MASK, PC_INT_CLEAR, PC_TASK_CON, PC_OP_EN = 0x10, 0x14, 0x20, 0x24, 0x30, 0x08


class FakeNpu:
    def __init__(self, memory=None, n_cores: int = 3, raise_bits: int = 0x100, hang: bool = False,
                 on_run: Callable[[object, int], None] | None = None) -> None:
        self.memory, self.n_cores = memory, n_cores
        self.raise_bits, self.hang, self.on_run = raise_bits, hang, on_run
        self.writes: list[tuple[int, int, int]] = []
        self.regs: list[dict[int, int]] = [{} for _ in range(n_cores)]
        self.raw = [0] * n_cores
        self.task_status = [0] * n_cores
        self.executed = [0] * n_cores
        self.resets: list[int | None] = []
        self.busy_seconds = 0.0       # sim.kernel.NpuModel: no model time here

    def mmio_write(self, core: int, offset: int, value: int) -> None:
        self.writes.append((core, offset, value))
        if offset == PC_INT_CLEAR:
            self.raw[core] &= ~value
        self.regs[core][offset] = value
        if offset == PC_OP_EN and value == 1:
            self._run(core)

    def _run(self, core: int) -> None:
        regs = self.regs[core]
        addr, amount = regs[PC_BASE] & ~0xF, regs[PC_AMOUNTS]
        number = regs[PC_TASK_CON] & 0xFFF
        for _ in range(number):
            words = self.memory.view(addr, (amount + 1) * 2 * 8).view(np.uint64)
            self.executed[core] += 1
            self.task_status[core] += 1
            tail = [int(w) for w in words if (int(w) >> 48) == 0x0101]
            nxt = {int(w) & 0xFFFF: (int(w) >> 16) & 0xFFFFFFFF for w in tail}
            addr, amount = nxt.get(PC_BASE, 0) & ~0xF, nxt.get(PC_AMOUNTS, 0)
            if addr == 0:
                break
        if self.on_run:
            self.on_run(self.memory, core)
        if not self.hang:
            self.raw[core] |= self.raise_bits

    def mmio_read(self, core: int, offset: int) -> int:
        if offset == 0x28:
            return self.raw[core] & self.regs[core].get(PC_INT_MASK, 0)
        if offset == 0x2C:
            return self.raw[core]
        if offset == 0x3C:
            return self.task_status[core]
        return self.regs[core].get(offset, 0)

    def soft_reset(self, core: int | None = None) -> None:
        self.resets.append(core)
        for c in range(self.n_cores) if core is None else [core]:
            self.regs[c], self.raw[c], self.task_status[c] = {}, 0, 0

    def diagnostics(self, core: int) -> list[str]:
        return [f"fake: core {core} executed {self.executed[core]} tasks, hang={self.hang}"]

    def executed_tasks(self, core: int) -> int:
        return self.executed[core]


def attach(kernel, **kwargs) -> FakeNpu:
    """A FakeNpu wired to ``kernel``'s MMU the way SimKernel wires its own SimNpu."""
    npu = FakeNpu(kernel.mmu, kernel.n_cores, **kwargs)
    kernel._npu = npu
    return npu


def regcmd_words(body_words: int, next_addr: int = 0, next_body: int = 0, enable: int = 0x0D) -> np.ndarray:
    """A body of NOP-ish CNA writes plus the 4-word tail [npu-programming.md §2]."""
    body = [(0x0201 << 48) | (0x1040) for _ in range(body_words)]
    amount = ceil_div(next_body + 4, 2) - 1 if next_addr else 0
    tail = [
        ((0x0101 << 48) | (next_addr << 16) | 0x0010) if next_addr else 0,
        ((0x0101 << 48) | (amount << 16) | 0x0014) if next_addr else 0,
        0x0041 << 48,
        (0x0081 << 48) | (enable << 16) | 0x0008,
    ]
    return np.array(body + tail, dtype=np.uint64)
