"""Pure functions: matmul shape + dtypes -> ``Program`` (regcmd words, task table,
relocations). No I/O; deterministic; golden-testable."""

from ggml_rknpu.compiler.layout import pack_a, pack_b, unpack_c
from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.compiler.program import Program, ProgramTask, Reloc
from ggml_rknpu.compiler.shape import MatmulShape

__all__ = ["MatmulShape", "Program", "ProgramTask", "Reloc", "compile_matmul", "pack_a", "pack_b", "unpack_c"]
