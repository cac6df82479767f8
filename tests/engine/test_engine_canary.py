"""Canaries: one per (task, output plane), at the task's last row, read from the words;
every one is caught while unwritten, and a full write clears them all."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.engine.canary import Canaries
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import ceil_div


@pytest.mark.parametrize("M,K,N,dtype,out", [(1, 1536, 8960, "fp16", "fp32"), (300, 9000, 100, "fp16", "fp32"),
                                             (5, 64, 1001, "fp16", "fp16"), (700, 4096, 96, "int8", "int32")])
def test_one_canary_per_task_and_plane_each_caught(M, K, N, dtype, out):
    p = compile_matmul(M, K, N, dtype=dtype, out=out)
    c = Canaries.for_program(p)
    c2 = limits.c2(p.c_dtype)
    assert c.elements.size == sum(ceil_div(kernels, c2) for kernels in _kernels(p))
    assert len(set(c.elements.tolist())) == c.elements.size          # no two tasks share a canary
    buf = np.zeros(p.c_bytes, np.uint8)
    c.arm(buf)
    assert c.unwritten(buf) == c.elements.size
    view = buf.view(c.pattern.dtype)
    keep = c.elements[len(c.elements) // 2]
    saved = view[keep]
    view[:] = 0                                                        # the NPU wrote everything ...
    assert c.unwritten(buf) == 0
    view[keep] = saved                                                 # ... but one atom
    assert c.unwritten(buf) == 1


def _kernels(program):
    from ggml_rknpu.hw.envelope import decode_task

    return [decode_task(program.words[t.word_offset: t.word_offset + t.body_words]).kernels for t in program.tasks]
