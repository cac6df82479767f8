"""The GEMM of a conv task: exact int8 x int8 -> int32, fp16 products summed in fp32, and
``Gemm``, the same on host threads for one-row fp16 tasks over large weights.

Numerics and their sources: ``sim/conv.py``'s module doc and docs/decisions.md "sim/conv.py";
the host-thread split: docs/simulator.md."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.sim.validate import NotModeled

INT8_EXACT_K_CHUNK = 1024      # 1024 * 2^14 = 2^24: exact integer partial sums in fp32


class GemmTask(Protocol):
    """What a GEMM reads of its task (a ``ConvTask``): the CNA precision."""

    @property
    def precision(self) -> str: ...


def multiply(task: GemmTask, a: np.ndarray, b_nk: np.ndarray) -> np.ndarray:
    """(M, N) accumulator: int64 exact for int8, float32 for fp16 (module docstring)."""
    if task.precision == "int8":
        acc = np.zeros((a.shape[0], b_nk.shape[0]), dtype=np.int64)
        for k0 in range(0, a.shape[1], INT8_EXACT_K_CHUNK):
            k1 = k0 + INT8_EXACT_K_CHUNK
            acc += (a[:, k0:k1] @ b_nk[:, k0:k1].T).astype(np.int64)
        if acc.size and int(np.abs(acc).max()) >= 1 << 31:
            raise NotModeled("int32 accumulator overflow (RK behaviour unverified [§10])")
        return acc
    return a @ b_nk.T


# A one-row fp16 GEMM over at least this many bytes of decoded weights is split across host
# threads: it streams them from DRAM for >= 2 ms on one core of the x86 dev box (gemma3-270m's
# output projection: 671 MB, ~42 ms), long enough that the hand-offs cost nothing; smaller
# ones (its 5 MB FFN weights) gained less than the hand-offs cost on a loaded host.
SPLIT_MIN_WEIGHT_BYTES = 32 << 20
SPLIT_BLOCK_BYTES = 2 << 20      # the threads share out blocks of at least this size,
SPLIT_MAX_BLOCKS = 16            # at most this many (each costs a hand-off)
SPLIT_ROW_ALIGN = 64


def _gemv_into(a: np.ndarray, b_kn: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b_kn, out=out)


class Gemm:
    """``multiply`` of a task, on up to ``threads`` host threads.

    A one-row (M=1) fp16 task over large weights runs as one BLAS call per contiguous block
    of weight rows; the blocks follow from the task's shape alone, and ``threads`` only
    decides how many host threads share them out (numpy releases the GIL in BLAS). So the
    result does not depend on the thread count, bit for bit, on any BLAS: the same calls on
    the same operands. It may differ from one unsplit call in the last fp32 bit, because a
    BLAS picks its kernel and its own thread split per shape (OpenBLAS with two threads sums
    the last columns of a 322-row gemv differently from a 130-row one): the model's fp16
    numerics leave the summation order open (module docstring). No block has one row:
    numpy computes a 1 x 1 result with sdot. Other tasks (M > 1, int8) run as ``multiply``.
    The host threads are a speed of this simulator on a multi-core host; they say nothing
    about the NPU."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self.split_calls = 0

    def __call__(self, task: GemmTask, a: np.ndarray, b_nk: np.ndarray) -> np.ndarray:
        n = b_nk.shape[0]
        if (task.precision != "fp16" or a.shape[0] != 1
                or b_nk.nbytes < SPLIT_MIN_WEIGHT_BYTES or n < 2 * SPLIT_ROW_ALIGN):
            return multiply(task, a, b_nk)
        n_blocks = min(SPLIT_MAX_BLOCKS, max(2, b_nk.nbytes // SPLIT_BLOCK_BYTES))
        rows = ceil_div(n, n_blocks * SPLIT_ROW_ALIGN) * SPLIT_ROW_ALIGN
        cuts = [j for j in range(rows, n, rows) if n - j >= 2]   # no one-row block (see above)
        out = np.empty((1, n), dtype=np.float32)
        blocks = [(a, b_nk[j0:j1].T, out[:, j0:j1]) for j0, j1 in zip([0, *cuts], [*cuts, n])]
        self.split_calls += 1
        if self.threads == 1:
            for block in blocks:
                _gemv_into(*block)
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="sim-gemm")
        # The workers take blocks from the front, this thread from the back: on a loaded
        # host it waits for at most the blocks a worker has started.
        futures = [self._pool.submit(_gemv_into, *block) for block in blocks[:-1]]
        _gemv_into(*blocks[-1])
        for block, future in zip(reversed(blocks[:-1]), reversed(futures)):
            if not future.cancel():
                break          # a worker has got this far: the blocks before are started
            _gemv_into(*block)
        for future in futures:
            if not future.cancelled():
                future.result()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


GemmFn = Callable[[GemmTask, np.ndarray, np.ndarray], np.ndarray]
