"""A second matmul engine over Rockchip's closed ``rknn_matmul_api`` (the seed's route 1),
a ``MatmulEngine`` like ``engine.NpuEngine``.

Invariants: each (weight, M bucket) gets a persistent context whose A, B and C are bound
once and B filled once, bounded by an LRU of ``max_contexts`` (default 32); only fp16 x
fp16 -> fp32 and int8 x int8 -> int32, the types validated on an RK3588, are ever run;
B is converted by the runtime's own native-layout call, K beyond 8192 is cut into chunks
summed on the host [docs/rknn-toolkit.md §4.4]; device seconds are *modeled*. Why
(docs/history.md §2, §8-10, §16): docs/decisions.md "rknn/engine.py"."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_rknpu.cost.model import RKNN_RUNTIME, modeled_time, vendor_style_workload
from ggml_rknpu.engine.contract import EngineWeight
from ggml_rknpu.engine.npu_weight import MAX_PROGRAM_M
from ggml_rknpu.engine.programs import m_bucket
from ggml_rknpu.engine.staging import (
    ResidentWeight,
    StagedWeight,
    check_matrix,
    dequantize_output,
    stage_activation,
    stage_weight,
)
from ggml_rknpu.engine.timing import Timing
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.rknn import binding as rb

TYPE_FOR_DTYPE = {"fp16": rb.FLOAT16_MM_FLOAT16_TO_FLOAT32, "int8": rb.INT8_MM_INT8_TO_INT32}
SUPPORTED_RK3588 = {
    1: "validated on RK3588 [docs/history.md §2]",
    2: "validated on RK3588 [docs/history.md §8]",
}
UNSUPPORTED_RK3588 = {
    5: "librknnrt on RK3588 refuses it: 'unsupported matmul dtype ... in this platform' [docs/history.md §8]",
    7: "librknnrt on RK3588 refuses it: 'unsupported matmul dtype ... in this platform' [docs/history.md §8]",
}
N_ALIGN = limits.KERNEL_GROUP        # the runtime's N alignment is the kernel group [docs/rknn-toolkit.md §4.4]
K_ALIGN = limits.K_ALIGN
K_CHUNK = 8192                       # RK3588 segments B beyond 8192 [§4.4]
IOVA_DOMAIN_BYTES = limits.ADDRESS_WINDOW_BYTES   # one IOMMU domain is the 4 GB space [§4.3 iommu_domain_id]
ELEMENT = {"fp16": np.float16, "int8": np.int8}


class RknnUnsupportedType(ValueError):
    """A matmul type this platform's runtime does not (or is not known to) support."""


def check_type(mtype: int) -> None:
    """Raise ``RknnUnsupportedType`` unless ``mtype`` is known to work on RK3588."""
    name = rb.MATMUL_TYPES.get(mtype, f"type {mtype}")
    if mtype in SUPPORTED_RK3588:
        return
    reason = UNSUPPORTED_RK3588.get(mtype, "not shown to work on RK3588 (unverified); not attempted")
    raise RknnUnsupportedType(f"{name}: {reason}")


@dataclass
class _Context:
    """One librknnrt context with its bound buffers; freed in the runtime's order."""

    ctx: int
    io: rb.MatmulIoAttr
    mems: tuple[Any, Any, Any]   # A, B, C
    nbytes: int
    modeled_s: float             # device seconds of one run, modeled (librknnrt profile)


class RknnWeight(ResidentWeight):
    """A weight staged on the host (converted, padded, in native layout per K chunk) and,
    per M bucket, resident in the contexts that use it."""

    def __init__(self, npu: RknnEngine, staged: StagedWeight, native_chunks: list[np.ndarray],
                 k_chunks: list[tuple[int, int]], n_padded: int) -> None:
        self.engine = npu             # the engine it was uploaded to
        self.staged = staged
        self.native_chunks = native_chunks
        self.k_chunks = k_chunks
        self.n_padded = n_padded
        self.freed = False

    @property
    def packed_bytes(self) -> int:
        """Host bytes of the native layout (what each context using it holds on the NPU)."""
        return sum(chunk.nbytes for chunk in self.native_chunks)

    def free(self) -> None:
        if not self.freed:
            self.engine.drop_weight(self)
            self.freed = True


class RknnEngine:
    """See the module docstring. ``library``: an ``RknnLibrary`` or a path to librknnrt.so
    (default: ``$LIBRKNNRT_PATH`` or the usual directories)."""

    def __init__(self, library: rb.RknnLibrary | str | None = None, *, max_contexts: int = 32,
                 core_mask: str = "auto") -> None:
        if max_contexts < 1:
            raise ValueError(f"max_contexts must be >= 1, got {max_contexts}")
        if core_mask not in rb.CORE_MASKS:
            raise ValueError(f"core_mask must be one of {sorted(rb.CORE_MASKS)}, got {core_mask!r}")
        self.lib = library if isinstance(library, rb.RknnLibrary) else rb.RknnLibrary(library)
        self.max_contexts = max_contexts
        self.core_mask = rb.CORE_MASKS[core_mask]
        self.counters: dict[str, int] = dict.fromkeys((
            "weights_uploaded", "weights_freed", "contexts_created", "contexts_destroyed",
            "context_cache_hits", "context_cache_misses", "b_bytes_staged", "matmuls", "runs"), 0)
        self.last_timing: Timing | None = None
        self._entries: OrderedDict[tuple[int, int], tuple[RknnWeight, list[_Context]]] = OrderedDict()
        self._weights: list[RknnWeight] = []
        self._bytes = 0
        self._closed = False

    @property
    def modeled_cores(self) -> int:
        """Cores the cost model prices a run on: those in the core mask; 1 for "auto" (the
        runtime's AUTO mask runs a matmul on one core: reading in ``cost/anchors.py``)."""
        return min(3, bin(self.core_mask & 0b111).count("1")) or 1

    def describe(self) -> str:
        return "librknnrt (the vendor runtime)"

    # -- weights ---------------------------------------------------------------------
    def upload_weight(self, b: np.ndarray, dtype: str = "fp16", *, matmul_type: int | None = None) -> RknnWeight:
        """Convert ``b`` [N, K] once (fp16, or int8 with per-row scales) into the native
        layout. ``matmul_type`` may name another rknn_matmul_type; unsupported ones raise
        ``RknnUnsupportedType`` before the runtime is touched."""
        self._check_open()
        mtype = TYPE_FOR_DTYPE.get(dtype) if matmul_type is None else matmul_type
        if mtype is None:
            raise ValueError(f"weight dtype must be one of {sorted(TYPE_FOR_DTYPE)}, got {dtype!r}")
        check_type(mtype)
        if TYPE_FOR_DTYPE.get(dtype) != mtype:
            raise ValueError(f"matmul_type {mtype} does not match dtype {dtype!r}")
        staged = stage_weight(b, dtype)
        N, K = staged.shape
        n_pad = align_up(N, N_ALIGN[dtype])
        k_pad = align_up(K, K_ALIGN)
        n_chunks = ceil_div(k_pad, K_CHUNK)
        per = ceil_div(k_pad // K_ALIGN, n_chunks) * K_ALIGN
        k_chunks = [(k0, min(per, k_pad - k0)) for k0 in range(0, k_pad, per)]
        padded = np.zeros((n_pad, k_pad), dtype=ELEMENT[dtype])
        padded[:N, :K] = staged.data
        native = []
        for k0, kc in k_chunks:
            info = rb.MatmulInfo(M=1, K=kc, N=n_pad, type=mtype, B_layout=rb.LAYOUT_NATIVE)
            b_kn = np.ascontiguousarray(padded[:, k0: k0 + kc].T)
            native.append(self.lib.b_normal_to_native(b_kn, info, b_kn.nbytes))
        weight = RknnWeight(self, staged.without_data(), native, k_chunks, n_pad)
        self._weights.append(weight)
        self.counters["weights_uploaded"] += 1
        return weight

    # -- matmul ----------------------------------------------------------------------
    def matmul(self, a: np.ndarray, w: EngineWeight, *, out: str | None = None) -> np.ndarray:
        self._check_open()
        if not isinstance(w, RknnWeight) or w.engine is not self:
            raise TypeError("w must be a weight returned by this engine's upload_weight")
        if w.freed:
            raise ValueError("this weight was freed; upload it again")
        if out not in (None, "fp32" if w.dtype == "fp16" else "int32"):
            raise ValueError(f"out={out!r} is not available for a {w.dtype} weight on the rknn engine")
        check_matrix(a, "a")
        N, K = w.shape
        if a.shape[1] != K:
            raise ValueError(f"shape mismatch: a is {a.shape[0]}x{a.shape[1]} but the weight "
                             f"is N={N} x K={K}; a must have K={K} columns")
        act = stage_activation(a, w.staged)
        M = a.shape[0]
        acc_dtype = np.float32 if w.dtype == "fp16" else np.int64
        result = np.zeros((M, N), dtype=acc_dtype)
        times = [0.0, 0.0, 0.0]       # pack A / sync A + run + sync C / unpack C (engine.timing.Timing)
        device_s = 0.0
        runs = 0
        for m0 in range(0, M, MAX_PROGRAM_M):
            rows = min(MAX_PROGRAM_M, M - m0)
            bucket = m_bucket(rows)
            contexts = self._contexts(w, bucket)
            for (k0, kc), c in zip(w.k_chunks, contexts):
                t0 = time.perf_counter()
                a_view = self.lib.mem_array(c.mems[0], ELEMENT[w.dtype], bucket * kc).reshape(bucket, kc)
                a_view[rows:] = 0                      # padding rows; padding columns stay 0
                src = act.data[m0: m0 + rows, k0: min(k0 + kc, K)]
                a_view[:rows, : src.shape[1]] = src
                t1 = time.perf_counter()
                self.lib.mem_sync(c.ctx, c.mems[0], rb.MEM_SYNC_TO_DEVICE)
                self.lib.matmul_run(c.ctx)
                self.lib.mem_sync(c.ctx, c.mems[2], rb.MEM_SYNC_FROM_DEVICE)
                t2 = time.perf_counter()
                c_dtype = np.float32 if w.dtype == "fp16" else np.int32
                c_view = self.lib.mem_array(c.mems[2], c_dtype, bucket * w.n_padded).reshape(bucket, w.n_padded)
                result[m0: m0 + rows] += c_view[:rows, :N]
                t3 = time.perf_counter()
                times = [t + d for t, d in zip(times, (t1 - t0, t2 - t1, t3 - t2))]
                device_s += c.modeled_s
                runs += 1
        self.counters["runs"] += runs
        self.counters["matmuls"] += 1
        t0 = time.perf_counter()
        c_out = result.astype(np.int32) if w.dtype == "int8" else result
        final = dequantize_output(c_out, act, w.staged)
        times[2] += time.perf_counter() - t0
        pack_s, submit_s, unpack_s = times
        self.last_timing = Timing(pack_s, submit_s, unpack_s, device_s=device_s, device_label="modeled", submits=runs)
        return final

    def _contexts(self, w: RknnWeight, bucket: int) -> list[_Context]:
        key = (id(w), bucket)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.counters["context_cache_hits"] += 1
            return entry[1]
        self.counters["context_cache_misses"] += 1
        needed = len(w.k_chunks)
        if needed > self.max_contexts:
            raise ValueError(f"this weight needs {needed} contexts per M bucket (K chunks) but "
                             f"max_contexts is {self.max_contexts}")
        while self._live_contexts() + needed > self.max_contexts:
            self._evict_oldest()
        contexts: list[_Context] = []
        try:
            for (_k0, kc), native in zip(w.k_chunks, w.native_chunks):
                contexts.append(self._create_context(w, bucket, kc, native))
        except BaseException:
            for c in contexts:
                self._destroy_context(c)
            raise
        self._entries[key] = (w, contexts)
        return contexts

    def _create_context(self, w: RknnWeight, m: int, k: int, native_b: np.ndarray) -> _Context:
        info = rb.MatmulInfo(M=m, K=k, N=w.n_padded, type=TYPE_FOR_DTYPE[w.dtype],
                             B_layout=rb.LAYOUT_NATIVE, AC_layout=rb.LAYOUT_NORM)
        ctx, io = self.lib.matmul_create(info)
        mems: list[Any] = []
        try:
            if self.core_mask:
                self.lib.matmul_set_core_mask(ctx, self.core_mask)
            for attr in (io.A, io.B, io.C):
                mem = self.lib.create_mem(ctx, attr.size)
                mems.append(mem)
                self.lib.matmul_set_io_mem(ctx, mem, attr)
            if io.B.size != native_b.nbytes:
                raise rb.RknnError("rknn_matmul_create", -5, f"runtime wants {io.B.size} B bytes, "
                                   f"native conversion gave {native_b.nbytes}")
            self.lib.mem_array(mems[0], np.uint8, io.A.size)[:] = 0
            self.lib.mem_array(mems[1], np.uint8, native_b.nbytes)[:] = native_b
            self.lib.mem_sync(ctx, mems[1], rb.MEM_SYNC_TO_DEVICE)
        except BaseException:
            for mem in mems:
                self.lib.destroy_mem(ctx, mem)
            self.lib.matmul_destroy(ctx)
            raise
        nbytes = io.A.size + io.B.size + io.C.size
        self._bytes += nbytes
        self.counters["contexts_created"] += 1
        self.counters["b_bytes_staged"] += native_b.nbytes
        modeled = modeled_time(vendor_style_workload(m, k, w.n_padded, dtype=w.dtype, cores=self.modeled_cores),
                               profile=RKNN_RUNTIME)
        return _Context(ctx, io, (mems[0], mems[1], mems[2]), nbytes, modeled.total_s)

    def _destroy_context(self, c: _Context) -> None:
        for mem in c.mems:
            self.lib.destroy_mem(c.ctx, mem)
        self.lib.matmul_destroy(c.ctx)
        self._bytes -= c.nbytes
        self.counters["contexts_destroyed"] += 1

    def _evict_oldest(self) -> None:
        _key, (_w, contexts) = self._entries.popitem(last=False)
        for c in contexts:
            self._destroy_context(c)

    def _live_contexts(self) -> int:
        return sum(len(cs) for _w, cs in self._entries.values())

    def drop_weight(self, w: RknnWeight) -> None:
        """Destroy every context that uses ``w`` (its ``free``)."""
        for key in [k for k, (weight, _cs) in self._entries.items() if weight is w]:
            for c in self._entries.pop(key)[1]:
                self._destroy_context(c)
        self._weights.remove(w)
        self.counters["weights_freed"] += 1

    # -- memory and lifecycle --------------------------------------------------------
    def memory_budget(self) -> tuple[int, int]:
        """(free, total) of one 4 GB IOMMU domain, minus what this engine holds. An
        estimate: the runtime has no query, and other processes are not counted."""
        return IOVA_DOMAIN_BYTES - self._bytes, IOVA_DOMAIN_BYTES

    def reset(self) -> None:
        """None: this engine binds no reset (the runtime functions it uses: docs/rknn-toolkit.md), so a fault is retried as is."""
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this engine is closed")

    def close(self) -> None:
        if self._closed:
            return
        for w in list(self._weights):
            w.free()
        self._closed = True

    def __enter__(self) -> RknnEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
