"""Canaries: detect NPU output that was never written, so a fault costs time, never a wrong
result.

WHY: mainline rocket kills a job after 500 ms and returns its outputs stale with no error
(rocket_job.c ``rocket_job_timedout``; rocket_gem.c ``rocket_ioctl_prep_bo`` returns 0);
a task that a board silently drops, or a core reset mid-chain, looks the same. Before a
submit, the last output row of every task, in every output plane it writes, is set to a
value the NPU cannot produce; after it, any such atom still holding the value means that
task did not finish, and the call is an NPU fault.

Cost: one 16-byte atom per (task, output plane), written and read with one vectorised
index each way (decode, M=1, N=4096 fp32: 1024 atoms, 16 KiB), plus the clean of the C
window the device then does because C is also listed as a job input. Which atoms, read
from each task's own words (DPU_DST_BASE_ADDR, DATAIN_HEIGHT, WEIGHT_KERNELS,
DST_SURF_STRIDE, OUT_PRECISION) so it holds whatever the tiling does.

Canary values (per output precision), impossible as results:
* int32: INT32_MIN. |sum| <= 128 * 128 * K = 2^14 K < 2^31 for every K < 131072, beyond
  any matmul we compile (DATAIN_CHANNEL is 16 bits).
* fp32 / fp16: a signalling-NaN payload (0x7FBADBAD / 0x7DBA). The NPU writes NaN only
  from NaN or Inf inputs, and then not this payload; if it ever did, the cost is a
  needless host fallback, not a wrong value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.envelope import decode_task

_ATOM = limits.ATOM_BYTES
PATTERN = {
    "int32": np.full(4, -2**31, np.int32).view(np.uint8),
    "fp32": np.full(4, 0x7FBADBAD, np.uint32).view(np.uint8),
    "fp16": np.full(8, 0x7DBA, np.uint16).view(np.uint8),
}


@dataclass(frozen=True, eq=False)
class Canaries:
    """The output atoms one program's canaries occupy (atom indices into its C buffer)."""

    atoms: np.ndarray      # int64 indices of 16-byte atoms
    pattern: np.ndarray    # 16 bytes

    @classmethod
    def for_program(cls, program) -> "Canaries":
        atoms = []
        out = None
        for task in program.tasks:
            t = decode_task(program.words[task.word_offset: task.word_offset + task.body_words])
            out = t.out_dtype
            plane_atoms = t.plane_rows * max(t.width, 1)
            first = t.c_offset // _ATOM + (t.rows * max(t.width, 1) - 1)
            planes = -(-t.kernels // limits.c2(t.out_dtype))
            atoms.append(first + plane_atoms * np.arange(planes, dtype=np.int64))
        if out not in PATTERN:
            raise ValueError(f"no canary value for output precision {out!r}")
        return cls(np.concatenate(atoms), PATTERN[out])

    def _view(self, c_bytes: np.ndarray) -> np.ndarray:
        return c_bytes.reshape(-1)[: c_bytes.size // _ATOM * _ATOM].reshape(-1, _ATOM)

    def arm(self, c_bytes: np.ndarray) -> None:
        """Write the canaries into the (CPU view of the) C buffer before a submit."""
        self._view(c_bytes)[self.atoms] = self.pattern

    def unwritten(self, c_bytes: np.ndarray) -> int:
        """How many canary atoms the NPU left untouched (0: every task finished)."""
        return int((self._view(c_bytes)[self.atoms] == self.pattern).all(axis=1).sum())
