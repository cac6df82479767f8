"""What a submit is made of, independent of the driver ABI: tasks per core, the buffer
ranges a job reads and writes, and what comes back.

Invariant: a ``Job`` names real buffers (``BufferRange``: a buffer, an offset, a size);
the driver ABI makes the input ranges visible to the NPU before a submit and the output
ranges visible to the CPU after it.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass

from ggml_rknpu.hw.limits import ADDRESS_WINDOW_BYTES, INT_MASK_DPU, MAX_TASKS_PER_SUBMIT, REGCMD_ALIGN
from ggml_rknpu.hw.regcmd import MATMUL_ENABLE
from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.errors import NpuError


@dataclass(frozen=True)
class HwTask:
    regcmd_addr: int  # DMA address of the task's first regcmd word (16-byte aligned)
    body_words: int  # regcmd words EXCLUDING the 4-word tail (vendor regcfg_amount)
    int_mask: int = INT_MASK_DPU
    enable_mask: int = int(MATMUL_ENABLE)  # CNA|CORE|DPU


@dataclass(frozen=True)
class BufferRange:
    """``size`` bytes of ``buffer`` from ``offset``: what a job reads or writes."""

    buffer: Buffer
    offset: int = 0
    size: int = 0

    @classmethod
    def whole(cls, buffer: Buffer) -> BufferRange:
        return cls(buffer, 0, buffer.size)


Cores = tuple[tuple[HwTask, ...], ...]  # cores[i]: tasks for core i in order; () = unused


def _ranges(items: tuple[Buffer | BufferRange, ...]) -> tuple[BufferRange, ...]:
    return tuple(i if isinstance(i, BufferRange) else BufferRange.whole(i) for i in items)


@dataclass(frozen=True, init=False)
class Job:
    """Tasks per core and the ranges they read (``inputs``) and write (``outputs``).
    A bare ``Buffer`` given as an input or output stands for its whole ``size``. ``domain``:
    the IOMMU domain every buffer of the job (regcmd, operands) is in; the submit names it."""

    cores: Cores
    inputs: tuple[BufferRange, ...]
    outputs: tuple[BufferRange, ...]
    domain: int

    def __init__(self, cores: Cores, inputs: tuple[Buffer | BufferRange, ...] = (),
                 outputs: tuple[Buffer | BufferRange, ...] = (), domain: int = 0) -> None:
        object.__setattr__(self, "cores", cores)
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "inputs", _ranges(inputs))
        object.__setattr__(self, "outputs", _ranges(outputs))


@dataclass(frozen=True)
class Completion:
    hw_elapsed_ns: int | None  # the driver's commit-to-IRQ time; None where it reports none
    task_counter: int
    simulated: bool


def check_cores(cores: Cores, n_cores: int,
                buffer_at: Callable[[int], Buffer | None]) -> tuple[Buffer, ...]:
    """Validate ``cores`` for any ABI; the distinct buffers holding their regcmd."""
    if len(cores) > n_cores:
        raise NpuError(f"job has task lists for {len(cores)} cores; this NPU has {n_cores}", errno.EINVAL)
    if not any(cores):
        raise NpuError("job has no tasks", errno.EINVAL)
    regcmd: dict[int, Buffer] = {}
    for core, tasks in enumerate(cores):
        if len(tasks) > MAX_TASKS_PER_SUBMIT:
            raise NpuError(f"core {core} has {len(tasks)} tasks; at most {MAX_TASKS_PER_SUBMIT} per submit "
                           "(TASK_CON.TASK_NUMBER is 12 bits): split the job", errno.EINVAL)
        for t in tasks:
            # IOVA 0 is a real address: mainline rocket gives it to a file's first buffer
            if t.regcmd_addr % REGCMD_ALIGN or not 0 <= t.regcmd_addr < ADDRESS_WINDOW_BYTES:
                raise NpuError(f"regcmd_addr {t.regcmd_addr:#x} must be a 16-byte aligned 32-bit NPU address",
                               errno.EINVAL)
            if t.body_words <= 0:
                raise NpuError(f"body_words must be > 0 (got {t.body_words})", errno.EINVAL)
            buf = buffer_at(t.regcmd_addr)
            if buf is None:
                raise NpuError(f"regcmd_addr {t.regcmd_addr:#x} is not inside any buffer of this device",
                               errno.EFAULT)
            regcmd[buf.handle] = buf
    return tuple(regcmd.values())
