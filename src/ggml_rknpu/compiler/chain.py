"""Several bound programs as one regcmd image: one submit runs them all.

Invariants: the members' bound words are laid out one after another; per core, the last
task of a member gets a tail pointing at the first task of the next member that uses that
core, so the same words serve both ABIs (the vendor driver follows the tails, rocket gets
one job per core listing all the tasks). The caller keeps the one rule: members are
independent, since nothing orders one core's tasks against another's. How and why:
docs/compiler.md "Chained programs"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.regcmd import MATMUL_ENABLE, TAIL_WORDS, task_tail

WORD_BYTES = 8


@dataclass(frozen=True)
class ChainedTask:
    """One task of a chained image: its first body word (inside the image) and body length."""

    core: int
    word_offset: int
    body_words: int
    enable_mask: int
    int_mask: int


def member_offsets(programs) -> list[int]:
    """Word offset of each member inside the image (members start task-aligned)."""
    align = limits.REGCMD_TASK_ALIGN // WORD_BYTES
    offsets, pos = [], 0
    for program in programs:
        offsets.append(pos)
        pos += align_up(int(program.words.size), align)
    return offsets


def image_words(programs) -> int:
    """Total words of the chained image of ``programs``."""
    if not programs:
        return 0
    last = programs[-1]
    return member_offsets(programs)[-1] + int(last.words.size)


def chain_image(programs, bound_words: list[np.ndarray], regcmd_addr: int) -> tuple[np.ndarray, tuple[tuple[ChainedTask, ...], ...]]:
    """The chained regcmd image of ``programs`` (their words already bound with
    ``Program.bind(..., regcmd=regcmd_addr + member offset)``) placed at ``regcmd_addr``,
    and per core the tasks in execution order."""
    if len(programs) != len(bound_words) or not programs:
        raise ValueError("chain_image needs one bound word array per program, at least one")
    if regcmd_addr % limits.REGCMD_TASK_ALIGN:
        raise ValueError(f"regcmd address 0x{regcmd_addr:X} must be {limits.REGCMD_TASK_ALIGN}-byte aligned")
    offsets = member_offsets(programs)
    image = np.zeros(image_words(programs), dtype=np.uint64)
    n_cores = 1 + max(t.core for p in programs for t in p.tasks)
    per_core: list[list[ChainedTask]] = [[] for _ in range(n_cores)]
    for program, words, base in zip(programs, bound_words, offsets):
        image[base: base + words.size] = words
        for task in program.tasks:
            per_core[task.core].append(ChainedTask(task.core, base + task.word_offset, task.body_words,
                                                   task.enable_mask, task.int_mask))
    for tasks in per_core:
        for cur, nxt in zip(tasks, tasks[1:]):
            tail_at = cur.word_offset + cur.body_words
            tail = task_tail(regcmd_addr + nxt.word_offset * WORD_BYTES, nxt.body_words, MATMUL_ENABLE)
            image[tail_at: tail_at + TAIL_WORDS] = np.array(tail, dtype=np.uint64)
    return image, tuple(tuple(t) for t in per_core)
