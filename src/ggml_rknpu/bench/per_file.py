"""A compiled multi-core program run under mainline rocket the way its scheduler lets cores
work side by side: one open file per core used, each holding that core's share of A, B and C
(a slice where the core's tasks touch a range no other core touches, so a weight split by
output rows is mapped once over all files; the whole buffer where the cores share it) and its
own register commands; every file's jobs launched before any is waited for.
Why: docs/npu-programming.md "What the drivers really do" (a file per core)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ggml_rknpu.compiler.program import Program, Reloc
from ggml_rknpu.kernel.device import BufferRange, Launched, NpuDevice, open_node

ROLES = ("A", "B", "C")


@dataclass(frozen=True)
class CoreShare:
    """One core's program (its tasks and their relocations only, offsets relative to its slices) and
    the byte range [lo, hi) of A, B and C its file holds."""

    core: int
    program: Program
    ranges: dict[str, tuple[int, int]]


def _task_relocs(program: Program, core: int) -> list[Reloc]:
    spans = [(t.word_offset, t.word_offset + t.body_words + 4) for t in program.core_tasks(core)]
    return [r for r in program.relocs if any(lo <= r.word_index < hi for lo, hi in spans)]


def core_shares(program: Program) -> list[CoreShare]:
    """Each used core's share (module doc): a role's range is the span from the core's first
    offset to the next core's, or the whole buffer when another core's offsets fall inside it."""
    cores = sorted({t.core for t in program.tasks})
    relocs = {c: _task_relocs(program, c) for c in cores}
    sizes = {"A": program.a_bytes, "B": program.b_bytes, "C": program.c_bytes}
    offsets = {c: {role: [r.offset for r in relocs[c] if r.role == role] for role in ROLES} for c in cores}
    shares = []
    for c in cores:
        ranges = {}
        for role in ROLES:
            mine, others = offsets[c][role], [o for d in cores if d != c for o in offsets[d][role]]
            lo = min(mine, default=0)
            shared = not mine or any(lo <= o <= max(mine) for o in others)
            hi = sizes[role] if shared else min([o for o in others if o > lo] + [sizes[role]])
            ranges[role] = (0, sizes[role]) if shared else (lo, hi)
        shifted = tuple(Reloc(r.word_index, r.role, r.offset - ranges[r.role][0]) if r.role in ranges else r
                        for r in relocs[c])
        size = {role: hi - lo for role, (lo, hi) in ranges.items()}
        shares.append(CoreShare(c, replace(program, tasks=program.core_tasks(c), relocs=shifted, a_bytes=size["A"], b_bytes=size["B"],
                                           c_bytes=size["C"]), ranges))
    return shares


def run_per_file(dev: NpuDevice, program: Program, a_packed: np.ndarray, b_packed: np.ndarray,
                 c_host: np.ndarray) -> None:
    """Run ``program`` with a file per used core (``dev`` is the first; the others are opened
    on its node and closed after): A and B packed whole on the host, C written back into
    ``c_host`` (whose canaries the caller armed) from every core's range."""
    from ggml_rknpu.engine.bound_program import program_jobs

    shares = core_shares(program)
    files = [dev] + [open_node(dev.syscalls, dev.path, simulated=dev.simulated) for _ in shares[1:]]
    buffers = []
    try:
        launched: list[Launched] = []
        outputs = []
        for share, f in zip(shares, files):
            host = {"A": a_packed, "B": b_packed, "C": c_host}
            bufs = {}
            for role, (lo, hi) in share.ranges.items():
                buf = f.alloc(max(hi - lo, 1))
                buffers.append(buf)
                buf.array()[: hi - lo] = host[role][lo:hi]
                bufs[role] = buf
            bufs["B"].sync_to_device()
            regcmd = f.alloc(share.program.regcmd_bytes, purpose="regcmd")
            buffers.append(regcmd)
            words = share.program.bind(a=bufs["A"].dma_addr, b=bufs["B"].dma_addr, c=bufs["C"].dma_addr,
                                       regcmd=regcmd.dma_addr)
            regcmd.array(np.uint64)[: words.size] = words
            for job in program_jobs(share.program, regcmd.dma_addr, f.n_cores,
                                    BufferRange.whole(bufs["A"]), BufferRange.whole(bufs["C"])):
                if any(job.cores):      # a chain with none of this core's tasks
                    launched.append(f.launch(job))
            outputs.append((share.ranges["C"], bufs["C"]))
        for started in launched:
            started.device.wait(started)
        for (lo, hi), buf in outputs:
            c_host[lo:hi] = buf.array()[: hi - lo]
    finally:
        for buf in buffers:
            buf.close()
        for f in files[1:]:
            f.close()
