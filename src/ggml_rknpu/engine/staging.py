"""Host-side conversion of weights and activations into what the NPU multiplies: the number
format is an engine decision, made once per weight at upload and per call for activations
(the compiler only packs already-typed arrays).

* fp16: round-to-nearest-even (numpy ``astype``) [docs/rknn-toolkit.md §1.5]; a finite value
  beyond the fp16 range is refused instead of becoming inf.
* int8 from int8: as is (exact int8 x int8 -> int32 [docs/npu-programming.md §10]).
* int8 from float: per-row symmetric, scale = max|row| / 127, round-half-even into
  [-127, 127] [docs/rknn-toolkit.md §4.2 PER_CHANNEL_SYM]; an all-zero row gets scale 1.
* float activations on an int8 weight: quantised the same way per row, so
  C = (A_q . B_q^T) * a_scale[:, None] * b_scale[None, :]."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WEIGHT_DTYPES = ("fp16", "int8")
FP16_MAX = float(np.finfo(np.float16).max)  # 65504 [IEEE 754 binary16]
INT8_QMAX = 127


@dataclass(frozen=True)
class StagedWeight:
    """A weight converted for the NPU: ``data`` [N, K] in ``dtype`` ("fp16" -> float16,
    "int8" -> int8); ``scales`` float32 [N] when int8 was quantised from float, else None."""

    data: np.ndarray
    dtype: str
    scales: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape  # type: ignore[return-value]

    def without_data(self) -> StagedWeight:
        """The same weight with its host copy released (a zero-byte read-only view keeps the
        shape and element type): what an engine holds once the data is in device memory,
        so a resident model does not also occupy host RAM."""
        return StagedWeight(np.broadcast_to(np.zeros((), self.data.dtype), self.data.shape),
                            self.dtype, self.scales)


class ResidentWeight:
    """What both engines' weight handles expose: ``shape`` (N, K), ``dtype`` and ``scales``,
    read from the ``staged`` weight they were made from."""

    staged: StagedWeight

    @property
    def shape(self) -> tuple[int, int]:
        return self.staged.shape

    @property
    def dtype(self) -> str:
        return self.staged.dtype

    @property
    def scales(self) -> np.ndarray | None:
        return self.staged.scales


def check_matrix(x: np.ndarray, what: str) -> np.ndarray:
    """``x`` as a 2-D numpy array with at least one element; ValueError saying what is wrong."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(x).__name__}")
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{what} must be a non-empty 2-D array, got shape {x.shape}")
    return x


def _is_float(x: np.ndarray) -> bool:
    return np.issubdtype(x.dtype, np.floating)


def to_fp16(x: np.ndarray, what: str) -> np.ndarray:
    """float / int8 array -> float16 (RNE); ValueError if a finite value overflows fp16."""
    if not (_is_float(x) or x.dtype == np.int8):
        raise TypeError(f"{what} must be float16/32/64 or int8 for fp16, got {x.dtype}")
    if _is_float(x):
        finite = np.isfinite(x)
        if not finite.all():
            raise ValueError(f"{what} contains {int((~finite).sum())} NaN/inf values")
        peak = float(np.abs(x).max())
        if peak > FP16_MAX:
            raise ValueError(f"{what} has |value| {peak:g} beyond the fp16 range (65504); "
                             "scale it or use dtype='int8'")
    return np.ascontiguousarray(x, dtype=np.float16)


def quantize_rows_int8(x: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8: (q int8 [R, C], scale float32 [R]) with x ~= q * scale[:, None]."""
    if not _is_float(x):
        raise TypeError(f"{what} must be a float array to quantise to int8, got {x.dtype}")
    xf = np.asarray(x, dtype=np.float32)
    finite = np.isfinite(xf)
    if not finite.all():
        raise ValueError(f"{what} contains {int((~finite).sum())} NaN/inf values")
    peak = np.abs(xf).max(axis=1)
    scale = (peak / INT8_QMAX).astype(np.float32)
    # an all-zero row, or one so tiny that peak / 127 underflows to 0, gets scale 1 (q = 0)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.rint(xf / scale[:, None])
    np.clip(q, -INT8_QMAX, INT8_QMAX, out=q)
    return q.astype(np.int8), scale


def stage_weight(b: np.ndarray, dtype: str) -> StagedWeight:
    """Convert a ggml-layout weight [N, K] (one row per output) for upload."""
    check_matrix(b, "weight")
    if dtype == "fp16":
        return StagedWeight(to_fp16(b, "weight"), "fp16", None)
    if dtype == "int8":
        if b.dtype == np.int8:
            return StagedWeight(np.ascontiguousarray(b), "int8", None)
        if _is_float(b):
            q, scale = quantize_rows_int8(b, "weight")
            return StagedWeight(q, "int8", scale)
        raise TypeError(f"an int8 weight must be int8 or float, got {b.dtype}")
    raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")


@dataclass(frozen=True)
class StagedActivation:
    """Activations converted to the weight's number format; ``scales`` [M] when quantised."""

    data: np.ndarray
    scales: np.ndarray | None


def stage_activation(a: np.ndarray, weight: StagedWeight) -> StagedActivation:
    """Convert ``a`` [M, K] to match ``weight``: fp16 weight -> fp16 a; int8 weight with
    int8 a -> as is (exact int32 result); int8 weight with float a -> per-row int8."""
    if weight.dtype == "fp16":
        return StagedActivation(to_fp16(a, "activation"), None)
    if a.dtype == np.int8:
        return StagedActivation(np.ascontiguousarray(a), None)
    if _is_float(a):
        q, scale = quantize_rows_int8(a, "activation")
        return StagedActivation(q, scale)
    raise TypeError(f"activations for an int8 weight must be int8 or float, got {a.dtype}")


def dequantize_output(c: np.ndarray, act: StagedActivation, weight: StagedWeight) -> np.ndarray:
    """The caller's result from the NPU's: int32 stays int32 when both sides were int8 as
    given; any quantised side turns it into float32 with its scales applied."""
    if weight.dtype == "fp16" or (act.scales is None and weight.scales is None):
        return c
    out = c.astype(np.float32)
    if act.scales is not None:
        out *= act.scales[:, None]
    if weight.scales is not None:
        out *= weight.scales[None, :]
    return out
