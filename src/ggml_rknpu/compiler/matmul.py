"""``compile_matmul``: matmul shape -> ``Program`` (pure, cached).

The compiled program depends only on (M, K, N, dtype, out, cores, abi, envelope); the same
``Program`` is re-bound to new buffer addresses with ``Program.bind`` on every call,
so hot paths compile once per (weight, M bucket) and replay.
"""

from __future__ import annotations

from functools import lru_cache

from ggml_rknpu.compiler.program import Program, build_program
from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.compiler.tiling import tile
from ggml_rknpu.hw.envelope import PROVEN, Envelope, by_name


@lru_cache(maxsize=256)
def _compile(shape: MatmulShape, cores: int, abi: str, envelope: Envelope) -> Program:
    return build_program(tile(shape, cores, envelope), abi, envelope)


def compile_matmul(M: int, K: int, N: int, *, dtype: str = "fp16", out: str = "fp32",
                   cores: int = 1, abi: str = "rknpu", envelope: Envelope | str = PROVEN) -> Program:
    """C[M, N] = A[M, K] . B[K, N] as NPU tasks. ``dtype`` "fp16" | "int8";
    ``out`` "fp32" | "fp16" (fp16 in) | "int32" (int8 in); ``cores`` 1..3 (no more than the
    envelope allows: ``hw.envelope``, proven by default)."""
    return _compile(MatmulShape(M, K, N, dtype, out), cores, abi, by_name(envelope))
