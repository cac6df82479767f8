"""The verdict on one NPU matmul result, shared by the selftest sweeps and the ladder rungs:
int8 exact; fp16 within ``FP16_RTOL * (|A| @ |B|^T) + FP16_ATOL`` of numpy's float64 product
of the fp16-rounded operands (the bound the engine tests derive for fp32 summation)."""

from __future__ import annotations

import numpy as np

FP16_RTOL = 1e-3
FP16_ATOL = 1e-6


def reference(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "int8":
        return a.astype(np.int64) @ b.astype(np.int64).T
    return a.astype(np.float16).astype(np.float64) @ b.astype(np.float16).astype(np.float64).T


def compare(c: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: str) -> tuple[bool, float, int, dict | None]:
    """(ok, max abs error, mismatch count, first mismatch) under the module's rules."""
    ref = reference(a, b, dtype)
    if c.shape != ref.shape:
        return False, float("inf"), ref.size, {"shape": list(c.shape), "expected_shape": list(ref.shape)}
    err = np.abs(c.astype(np.float64) - ref.astype(np.float64))
    if dtype == "int8":
        bad = err != 0
    else:
        bound = FP16_RTOL * (np.abs(a.astype(np.float16).astype(np.float64))
                             @ np.abs(b.astype(np.float16).astype(np.float64)).T) + FP16_ATOL
        bad = ~(err <= bound)
    n_bad = int(bad.sum())
    first = None
    if n_bad:
        i, j = map(int, np.argwhere(bad)[0])
        first = {"row": i, "col": j, "got": float(c[i, j]), "expected": float(ref[i, j])}
    return n_bad == 0, float(err.max()) if err.size else 0.0, n_bad, first


def corrupt_one(c: np.ndarray) -> None:
    """The test hook: change one output element by at least 1 (caught by both rules)."""
    i, j = c.shape[0] // 2, c.shape[1] // 2
    c[i, j] = -c[i, j] - 1
