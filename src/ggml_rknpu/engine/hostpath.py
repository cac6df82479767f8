"""The host side of one NPU submit, planned once: activations in, results out, through views.

Invariants: a program's A and C windows get their native-layout views once; a call is a
few numpy operations, with no Python loop over rows, tasks or K chunks; K padding of A is
zeroed on every write (the A buffer is shared by programs of other K); the int8
arithmetic is ``engine.staging``' own, so results are bit-identical to its staging path; a
wrong shape or a non-finite or out-of-fp16-range activation raises ValueError before the
submit. Why and what each port does: docs/decisions.md "engine/hostpath.py"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ggml_rknpu.compiler.layout import NUMPY_DTYPE, a_bytes, c_bytes, partial_dtype
from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.engine.staging import FP16_MAX, INT8_QMAX
from ggml_rknpu.hw import limits

if TYPE_CHECKING:
    from ggml_rknpu.compiler.program import Program

_FP32_TINY = np.float32(np.finfo(np.float32).tiny)   # smallest normal float32
_ATOM = np.dtype("V16")   # one 16-byte C atom [docs/npu-programming.md §6], moved as a whole


class ActivationPort:
    """Writes [rows <= M, K] activations into one program's A region."""

    def __init__(self, shape: MatmulShape, quantize: bool) -> None:
        self.shape = shape
        self.quantize = quantize           # float rows -> per-row int8 (int8 weight)
        self.raw: np.ndarray | None = None
        c2 = shape.c2_in
        self._full, self._rest = divmod(shape.K, c2)
        self._c2 = c2
        self._padded = shape.Kp > shape.K
        self.scales = np.ones(shape.M, np.float32)

    def bind(self, raw: np.ndarray) -> None:
        """Make the views over ``raw`` (uint8, the mapped bytes the program reads A from)."""
        s = self.shape
        nbytes = a_bytes(s)
        if raw.dtype != np.uint8 or raw.size < nbytes:
            raise ValueError(f"A region must be >= {nbytes} uint8 bytes")
        self.raw = raw
        dest = raw[:nbytes].view(NUMPY_DTYPE[s.dtype]).reshape(s.Kp // self._c2, s.M, self._c2)
        self._dest = dest
        self._flat = dest.reshape(-1) if s.M == 1 else None     # M = 1: A is K contiguous values
        self._flat_k = self._flat[: s.K] if self._flat is not None else None
        self._flat_pad = self._flat[s.K:] if self._flat is not None else None
        self._body = dest[: self._full]
        self._tail = dest[self._full] if self._rest else None
        self._pad = dest[self._full + (1 if self._rest else 0):]

    def write(self, x: np.ndarray) -> np.ndarray | None:
        """``x`` float [rows, K] (or int8 for an int8 program: taken as is, exact) into the
        bound A region; returns the per-row scales when ``x`` was quantised, else None."""
        s = self.shape
        if x.ndim != 2 or x.shape[1] != s.K or not 1 <= x.shape[0] <= s.M:
            raise ValueError(f"activation has shape {x.shape}; this program takes [1..{s.M}, {s.K}]")
        rows = x.shape[0]
        if x.dtype == np.int8:
            if s.dtype != "int8":
                raise TypeError("int8 activations need an int8 weight")
            self._place(x, rows)
            return None
        if x.dtype.kind != "f":
            raise TypeError(f"activations must be float (or int8 for an int8 weight), got {x.dtype}")
        # per call, not per port: a cached program keeps its port, and a port's own [M, K]
        # float32 (8 MiB at M 512, K 4096) would stay with every program of every file
        tmp = np.empty((rows, s.K), np.float32)
        if self.quantize and x.dtype != np.float32:
            x = x.astype(np.float32)       # quantize_rows_int8 works in float32
        np.abs(x, out=tmp)
        if self.quantize:
            return self._quantize_into(x, tmp, rows)
        # fp16: refuse what would become inf/NaN (NaN makes the peak NaN: the test fails)
        if not tmp.max() <= FP16_MAX:
            raise ValueError("activation has NaN/inf values or |value| beyond the fp16 range (65504)")
        self._place(x, rows)
        return None

    def _quantize_into(self, x: np.ndarray, tmp: np.ndarray, rows: int) -> np.ndarray:
        """Per-row symmetric int8, the arithmetic of ``quantize_rows_int8``: scale =
        peak / 127 (1 where that is 0), q = rint(x / scale). No clip is needed for a normal
        scale: |x| <= peak, so |x / fl(peak / 127)| <= 127 (1 + 2^-23) and rounds to <= 127."""
        scales = self.scales[:rows]
        if rows == 1:
            peak = tmp.max()
            if not np.isfinite(peak):
                raise ValueError("activation has NaN/inf values")
            scale = peak / np.float32(INT8_QMAX)
            scales[0] = scale if scale > 0 else np.float32(1.0)
            np.divide(x, scales[0], out=tmp)
        else:
            peak = tmp.max(axis=1)
            if not np.isfinite(peak).all():
                raise ValueError("activation has NaN/inf values")
            np.divide(peak, np.float32(INT8_QMAX), out=scales)
            scales[scales <= 0] = 1.0
            np.divide(x, scales[:, None], out=tmp)
        np.rint(tmp, out=tmp)
        if scales.min() < _FP32_TINY:
            # a subnormal scale has fewer significant bits: the bound above fails, clip
            np.clip(tmp, -INT8_QMAX, INT8_QMAX, out=tmp)
        self._place(tmp, rows)
        return scales

    def _place(self, src: np.ndarray, rows: int) -> None:
        """``src`` [rows, K] into the native A layout, casting to the program's type; the
        K padding and the rows beyond ``rows`` are zeroed (the buffer is shared)."""
        if self._flat_k is not None and self._flat_pad is not None:
            self._flat_k[...] = src[0]
            if self._padded:
                self._flat_pad[...] = 0
            return
        full, c2 = self._full, self._c2
        self._body[:, :rows] = src[:, : full * c2].reshape(rows, full, c2).transpose(1, 0, 2)
        if self._tail is not None:
            self._tail[:rows, : self._rest] = src[:, full * c2:]
            self._tail[:, self._rest:] = 0
        self._pad[...] = 0
        self._dest[:, rows:] = 0


class ResultPort:
    """Reads one program's C region into caller rows (partials summed, int8 scales applied)."""

    def __init__(self, program: Program, weight_scales: np.ndarray | None, out_dtype: npt.DTypeLike) -> None:
        shape: MatmulShape = program.shape
        self.shape = shape
        self.k_splits = program.k_splits
        self.pdt = partial_dtype(shape, self.k_splits)
        self.c2 = limits.c2(self.pdt)
        self.weight_scales = weight_scales
        self.out_dtype = np.dtype(out_dtype)
        sum_dtype = np.int32 if self.pdt == "int32" else np.float32
        self._sum = (np.empty((shape.Np // self.c2, shape.M, self.c2), sum_dtype)
                     if self.k_splits > 1 else None)

    def bind(self, raw: np.ndarray) -> None:
        s = self.shape
        nbytes = c_bytes(s, self.k_splits)
        if raw.dtype != np.uint8 or raw.size < nbytes:
            raise ValueError(f"C region must be >= {nbytes} uint8 bytes")
        self._vals = raw[:nbytes].view(NUMPY_DTYPE[self.pdt]).reshape(
            self.k_splits, s.Np // self.c2, s.M, self.c2)
        # M = 1 without a K split: C is N contiguous values, the whole read one copy
        self._native_m1 = (self._vals.reshape(-1)[: s.N].reshape(1, s.N)
                           if s.M == 1 and self.k_splits == 1 else None)
        # M > 1: a C atom (C2 values, 16 bytes) moves as one 16-byte item, so the transpose
        # out of (Np/C2, M, C2) is a 2-D copy of atoms; possible when the result has the
        # partials' item size and N is whole atoms
        self._atom_copy = (s.N % self.c2 == 0 and np.dtype(NUMPY_DTYPE[self.pdt]).itemsize == self.out_dtype.itemsize)
        self._sum_atoms = self._sum.reshape(-1).view(_ATOM).reshape(s.Np // self.c2, s.M) if self._sum is not None else None
        self._atoms = raw[:nbytes].view(_ATOM).reshape(self.k_splits, s.Np // self.c2, s.M)

    def read(self, out: np.ndarray, rows: int, act_scales: np.ndarray | None) -> np.ndarray:
        """Rows ``[:rows]`` of the result into ``out`` [>= rows, N] (its dtype: float32 when
        scales apply, else the program's output type); returns ``out[:rows]``.

        One pass from C into ``out`` (the transpose out of the native layout, the cast and
        the activation scale together: ``c.astype(float32) * a_scale`` computed in float32,
        as ``dequantize_output`` does), then one pass for the weight scales."""
        s = self.shape
        dest = out[:rows]
        src: np.ndarray | None
        if self._native_m1 is not None:
            src, dst = self._native_m1, dest
        elif self._atom_copy and dest.flags.c_contiguous:
            if self._sum is None:
                atoms = self._atoms[0]
            else:
                # int32 partials summed in int32 equal unpack_c's int64 sum cast back to
                # int32 (both wrap mod 2^32; exact while |C| < 2^31)
                np.sum(self._vals, axis=0, out=self._sum)
                atoms = self._sum_atoms
            np.copyto(dest.reshape(-1).view(_ATOM).reshape(rows, s.N // self.c2), atoms[: s.N // self.c2, :rows].T)
            dst = dest
            # int32 bits are converted in place below; float bits already are the result
            src = dest.view(np.int32) if self.pdt == "int32" and dest.dtype != np.int32 else None
        else:
            total = self._vals[0] if self._sum is None else np.sum(self._vals, axis=0, out=self._sum)
            src = total[:, :rows].transpose(1, 0, 2).reshape(rows, s.Np)[:, : s.N]
            dst = dest
        if src is not None:
            if act_scales is not None:
                np.multiply(src, act_scales[:rows, None], out=dst, dtype=np.float32, casting="unsafe")
            else:
                np.copyto(dst, src, casting="unsafe")
        elif act_scales is not None:
            dest *= act_scales[:rows, None]
        if self.weight_scales is not None:
            dest *= self.weight_scales[None, :]
        return dest


def bind_ports(program: Program, a_raw: np.ndarray, c_raw: np.ndarray, weight_scales: np.ndarray | None,
               out: str) -> tuple[ActivationPort, ResultPort]:
    """A program's two ports, bound to the mapped bytes of its A and C regions. ``out``:
    the matmul's output type ("fp32", "fp16", "int32")."""
    a_port = ActivationPort(program.shape, quantize=program.shape.dtype == "int8")
    a_port.bind(a_raw)
    c_port = ResultPort(program, weight_scales, np.float16 if out == "fp16" else np.float32)
    c_port.bind(c_raw)
    return a_port, c_port
