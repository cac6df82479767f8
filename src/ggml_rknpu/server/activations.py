"""``--activations ggml``: NPU matmul activations rounded as ggml-cpu rounds them.

ggml-cpu never multiplies a quantized weight by f32 activations: ``ggml_compute_forward_mul_mat``
(ggml-cpu.c) first converts src1 with ``type_traits_cpu[vec_dot_type].from_float``, where
``vec_dot_type`` is the weight type's partner (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1,
Q8_K for the k-quants, BF16 for BF16). Under ``--activations ggml`` each NPU step quantizes its
M rows with that same ggml function and dequantizes them back with ggml's own dequantizer, one
call each, before the engine's fp32 -> fp16 packing: one matmul then differs from ggml-cpu's by
the fp16 weights only. It is not the default: it does not bring a whole model closer to a CPU
run (docs/server.md "Activation numerics" has the measurements and why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_rknpu.libggml.enums import TYPE_NAMES, TYPE_TRAITS, GgmlType
from ggml_rknpu.libggml.lib import Ggml

ACTIVATION_MODES = ("fp16", "ggml")
# vec_dot types whose rounding the NPU's own fp16 conversion already is (F16: both round to
# nearest even) or that ggml-cpu does not round at all (F32)
_NO_ROUNDING = frozenset({int(GgmlType.F32), int(GgmlType.F16)})
# block_q8_1 (ggml-common.h) is block_q8_0 with ``ggml_half s`` after ``d``; ggml has no
# dequantizer for it (it is only ever a vec_dot operand), so its blocks are reread as Q8_0 blocks
_Q8_1_S = slice(2, 4)


@dataclass(eq=False)
class ActivationRounder:
    """One vec_dot type's quantize-and-back, over preallocated buffers that hold the largest
    step planned for it (grown at plan time only, so a replay never allocates)."""

    vec_dot_type: int
    quantize: Callable[[int, int, int], None]       # ggml-cpu from_float(src f32, dst blocks, n)
    dequantize: Callable[[int, int, int], None]     # ggml to_float(src blocks, dst f32, n)
    block: tuple[int, int]                          # (values, bytes) per block of vec_dot_type
    calls: int = 0
    packed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    out: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    q8_0: np.ndarray | None = None                  # Q8_1 only: its blocks without ``s``
    _addrs: tuple[int, int, int] = (0, 0, 0)        # packed, out, q8_0 (0: none)

    def reserve(self, n: int) -> None:
        """Room for ``n`` values (a multiple of the block: K is, for a quantized weight)."""
        if n <= self.out.size:
            return
        values, nbytes = self.block
        self.packed = np.zeros(n // values * nbytes, np.uint8)
        self.out = np.zeros(n, np.float32)
        if self.vec_dot_type == GgmlType.Q8_1:
            self.q8_0 = np.zeros(n // values * (nbytes - 2), np.uint8)
        self._addrs = (self.packed.ctypes.data, self.out.ctypes.data,
                       0 if self.q8_0 is None else self.q8_0.ctypes.data)

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (contiguous float32 [M, K]) as ggml-cpu's dot products see them; a view of
        this rounder's buffer, valid until its next call."""
        n = rows.size
        packed, out, q8_0 = self._addrs
        self.quantize(rows.ctypes.data, packed, n)
        if q8_0 and self.q8_0 is not None:
            blocks = self.packed[:n // self.block[0] * self.block[1]].reshape(-1, self.block[1])
            mine = self.q8_0[:blocks.shape[0] * (self.block[1] - 2)].reshape(blocks.shape[0], -1)
            mine[:, :_Q8_1_S.start] = blocks[:, :_Q8_1_S.start]
            mine[:, _Q8_1_S.start:] = blocks[:, _Q8_1_S.stop:]
            packed = q8_0
        self.dequantize(packed, out, n)
        self.calls += 1
        return self.out[:n].reshape(rows.shape)


class ActivationRounding:
    """The server's rounding policy: one :class:`ActivationRounder` per vec_dot type, shared by
    every step (steps run one at a time; each consumes the result before the next call)."""

    def __init__(self, ggml: Ggml, mode: str = "fp16") -> None:
        if mode not in ACTIVATION_MODES:
            raise ValueError(f"activation rounding {mode!r}: expected one of {ACTIVATION_MODES}")
        self.ggml, self.mode = ggml, mode
        self.rounders: dict[int, ActivationRounder] = {}

    def for_step(self, weight_type: int, a_type: int, n_values: int) -> ActivationRounder | None:
        """The rounder of an NPU step (``n_values`` = its largest M * K), or None: the engine
        gets the activations unchanged (mode fp16, activations that are not f32, weights
        whose vec_dot type is F32 or F16)."""
        if self.mode != "ggml" or a_type != GgmlType.F32:
            return None
        vdt = self.ggml.vec_dot_type(weight_type)
        if vdt in _NO_ROUNDING:
            return None
        rounder = self.rounders.get(vdt)
        if rounder is None:
            rounder = self.rounders[vdt] = self._rounder(vdt)
        rounder.reserve(n_values)
        return rounder

    def _rounder(self, vdt: int) -> ActivationRounder:
        g = self.ggml
        quantize = g.from_float(vdt)
        dequantize: Callable[[int, int, int], None] | None
        if vdt == GgmlType.Q8_K:
            dequantize = g.dequantize_row_q8_K
        else:
            dequantize = g.to_float(GgmlType.Q8_0 if vdt == GgmlType.Q8_1 else vdt)
        if quantize is None or dequantize is None:
            raise ValueError(f"ggml has no quantizer or dequantizer for {TYPE_NAMES.get(GgmlType(vdt), vdt)}")
        return ActivationRounder(vdt, quantize, dequantize, TYPE_TRAITS[GgmlType(vdt)])

    def as_dict(self) -> dict[str, Any]:
        """``--stats-json``'s ``activations``: the mode and the rounded steps per vec_dot type."""
        return {"mode": self.mode,
                "rounded_steps": {TYPE_NAMES[GgmlType(t)]: r.calls for t, r in sorted(self.rounders.items())}}


def as_f32_rows(rows: np.ndarray, type_id: int) -> np.ndarray:
    """src1 rows of a MUL_MAT or gathered for MUL_MAT_ID, as contiguous float32 (bf16 arrives as
    its raw uint16 view)."""
    if type_id == GgmlType.BF16:
        return (rows.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(rows, dtype=np.float32)


def npu_rows(rows: np.ndarray, type_id: int, k: int, rounder: ActivationRounder | None) -> np.ndarray:
    """An NPU step's activations as float32 [M, K], rounded as ggml-cpu would for the weight."""
    a = as_f32_rows(rows, type_id).reshape(-1, k)
    return a if rounder is None else rounder(a)
