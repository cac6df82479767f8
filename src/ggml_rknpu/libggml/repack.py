"""Weights in ggml-cpu's repacked layout: a host copy of a matmul weight in the CPU backend's
``CPU_REPACK`` extra buffer, the layout llama.cpp alone runs Q4_0, Q4_K, IQ4_NL, ... from.

ggml-cpu decides everything: the CPU device lists its extra buffer types
(``ggml_backend_dev_get_extra_bufts``); allocating a tensor in ``CPU_REPACK`` picks the
interleave for this CPU and shape (q4_0_8x8 on AVX2, q4_0_4x4 on the A76's NEON + dotprod,
none when the rows do not divide) into ``tensor->extra``; ``ggml_backend_tensor_set``
repacks; a MUL_MAT reading such a tensor runs the repacked kernel in ``ggml_graph_compute``.

Invariants: a :class:`RepackedWeight` exists only when ggml chose an interleave (else
:func:`repack` returns None: the plain path); :meth:`RepackedWeight.refresh` repacks into the
same tensor, so graphs pointing at it stay valid. Why: docs/placement.md "Repacked host copies"."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ggml_rknpu.libggml.lib import GGML_STATUS_SUCCESS, Ggml, TensorP

REPACK_BUFT = "CPU_REPACK"          # ggml_backend_cpu_repack_buffer_type_get_name (ggml-cpu repack.cpp)
_EXTRA_BUFTS = b"ggml_backend_dev_get_extra_bufts"
GetExtraBufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)

_BUFT: dict[int, int | None] = {}   # id(Ggml) -> the CPU_REPACK buffer type (None: this build has none)


def repack_buffer_type(g: Ggml) -> int | None:
    """ggml-cpu's ``CPU_REPACK`` buffer type among the CPU device's extra buffer types, or None."""
    key = id(g)
    if key not in _BUFT:
        found = None
        address = g.ggml_backend_reg_get_proc_address(g.ggml_backend_cpu_reg(), _EXTRA_BUFTS)
        if address:
            bufts = GetExtraBufts(address)(g.cpu_device)
            i = 0
            while bufts and bufts[i]:
                if (g.ggml_backend_buft_name(bufts[i]) or b"").decode() == REPACK_BUFT:
                    found = bufts[i]
                    break
                i += 1
        _BUFT[key] = found
    return _BUFT[key]


@dataclass(eq=False)
class RepackedWeight:
    """One weight ``[K, N]`` of ``type`` in a CPU_REPACK buffer, repacked from ``source``."""

    g: Ggml
    ctx: int
    buffer: int
    tensor: TensorP
    source: np.ndarray           # the plain GGUF bytes it was repacked from (a view in the server's buffer)
    nbytes: int

    def refresh(self) -> None:
        """Repack again from ``source`` (its bytes were rewritten)."""
        self.g.ggml_backend_tensor_set(self.tensor, self.source.ctypes.data, 0, self.nbytes)

    def close(self) -> None:
        """Free the buffer and the context; idempotent (taken before the free, as HostContext.close)."""
        buffer, self.buffer = self.buffer, 0
        ctx, self.ctx = self.ctx, 0
        if buffer:
            self.g.ggml_backend_buffer_free(buffer)
        if ctx:
            self.g.ggml_free(ctx)


def repack(g: Ggml, type_: int, k: int, n: int, source: np.ndarray, name: str = "") -> RepackedWeight | None:
    """A repacked copy of the contiguous weight ``[K = k, N = n]`` whose GGUF bytes are
    ``source`` (uint8, exactly ggml_nbytes), or None when ggml-cpu has no repacked layout for
    this type and shape on this CPU (or the build has no CPU_REPACK buffer)."""
    buft = repack_buffer_type(g)
    if buft is None:
        return None
    ctx = g.context(1)
    try:
        t = g.new_tensor(ctx, type_, (k, n, 1, 1))
        nbytes = g.ggml_nbytes(t)
        if source.nbytes != nbytes or not source.flags.c_contiguous:
            raise ValueError(f"repack '{name}': {source.nbytes} source bytes for a {nbytes}-byte [{k}, {n}] weight")
        buffer = g.ggml_backend_buft_alloc_buffer(buft, g.ggml_backend_buft_get_alloc_size(buft, t))
        if not buffer:
            raise MemoryError(f"repack '{name}': {REPACK_BUFT} buffer of {nbytes} bytes not allocated")
    except BaseException:
        g.ggml_free(ctx)
        raise
    w = RepackedWeight(g, ctx, buffer, t, source, nbytes)
    try:
        status = g.ggml_backend_tensor_alloc(buffer, t, g.ggml_backend_buffer_get_base(buffer))
        if status != GGML_STATUS_SUCCESS:
            raise MemoryError(f"repack '{name}': ggml_backend_tensor_alloc returned status {status}")
        if not t.contents.extra:        # ggml chose no interleave for this type/shape on this CPU
            w.close()
            return None
        t.contents.name = name.encode()[:63]
        w.refresh()
    except BaseException:
        w.close()
        raise
    return w
