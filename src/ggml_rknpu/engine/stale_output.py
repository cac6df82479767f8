"""Output the NPU never wrote: a canary in C before every submit, checked after it.

WHY: a job can "complete" without having run - mainline rocket's PREP_BO returns 0 with
the old bytes after a failed job (see ``sim/kernel.py``), and ``--sim-faults stale`` models
a vendor submit that returns 0 while C was not written. Nothing in the driver's answer
tells; the bytes do. Before a submit the engine fills the C window its program writes with
a canary word and cleans it to the device (without the clean a dirty line could be
written back over the NPU's result); after the submit any canary word left means the NPU
did not write that part of C, and ``StaleOutput`` is raised instead of returning it.

Canary words are values the NPU cannot produce in that partial type: fp32 0xFFFFFFFF and
fp16 0xFFFF are NaNs with every payload bit set (the NPU's inputs are finite fp16/int8;
a NaN it produced would not carry that payload - an assumption, not a board fact); int32
0x80000000 (INT32_MIN) lies beyond every int8 x int8 sum of a K chunk (|sum| <= 128 * 128
* 8192 < 2^31). A false alarm would cost a retry, never a wrong result.

The whole window is filled and compared (one memset and one vectorised compare of
``c_bytes``: a partially written C is caught as well as an unwritten one).

Engineer note: issue 12 plans an engine canary module; this is the stale-output half of
it, written so the two can become one (``arm`` / ``check`` around ``NpuDevice.submit``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ggml_rknpu.kernel.errors import NpuError

CANARY = {"fp32": (np.uint32, 0xFFFFFFFF), "fp16": (np.uint16, 0xFFFF), "int32": (np.uint32, 0x80000000)}


class StaleOutput(NpuError):
    """The job reported completion but (part of) C still holds the canary: it did not run."""


def _words(window: Any, program: Any) -> np.ndarray:
    dtype, _ = CANARY[program.c_dtype]
    return window.array(dtype)[: program.c_bytes // np.dtype(dtype).itemsize]


def arm(window: Any, program: Any) -> None:
    """Fill the C ``window`` of ``program`` with the canary and make it visible to the NPU."""
    _words(window, program).fill(CANARY[program.c_dtype][1])
    window.sync_to_device(0, program.c_bytes)


def check(window: Any, program: Any) -> None:
    """Raise ``StaleOutput`` if any canary word survived the submit."""
    words = _words(window, program)
    left = int(np.count_nonzero(words == CANARY[program.c_dtype][1]))
    if left:
        raise StaleOutput(f"matmul {program.shape}: the NPU reported the job complete but {left} of {words.size} "
                          "C words were never written (stale output)")
