"""ctypes binding of Rockchip's ``rknn_matmul_api`` (in the closed ``librknnrt.so``).

Invariants: nothing of the vendor's is in this repository (its header is marked
confidential and its licence grants no redistribution [docs/rknn-toolkit.md §4.6]): every
struct is written from the field tables of docs/rknn-toolkit.md §4.3 and its size and
offsets are asserted at import; the library is the user's, found at ``$LIBRKNNRT_PATH``,
then in the usual directories; 0 or positive is success, negative an error [§4.1], named
after a public error table (TensorStack ``rknn_utils.h``); -5 is also what the C prototype
saw on a board for a type the RK3588 runtime lacks [docs/history.md §8]."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

# --- enums [docs/rknn-toolkit.md §4.2] ------------------------------------------------------
MATMUL_TYPES = {
    1: "RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32",
    2: "RKNN_INT8_MM_INT8_TO_INT32",
    3: "RKNN_INT8_MM_INT8_TO_INT8",
    4: "RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT16",
    5: "RKNN_FLOAT16_MM_INT8_TO_FLOAT32",
    6: "RKNN_FLOAT16_MM_INT8_TO_FLOAT16",
    7: "RKNN_FLOAT16_MM_INT4_TO_FLOAT32",
    8: "RKNN_FLOAT16_MM_INT4_TO_FLOAT16",
    9: "RKNN_INT8_MM_INT8_TO_FLOAT32",
    10: "RKNN_INT4_MM_INT4_TO_INT16",
    11: "RKNN_INT8_MM_INT4_TO_INT32",
    12: "RKNN_FLOAT16_MM_INT4_TO_BFLOAT16",
    15: "RKNN_INT8_MM_INT4_TO_FLOAT16",
}
FLOAT16_MM_FLOAT16_TO_FLOAT32 = 1
INT8_MM_INT8_TO_INT32 = 2

LAYOUT_NORM, LAYOUT_NATIVE, LAYOUT_TP_NORM = 0, 1, 2          # rknn_matmul_layout
QUANT_PER_LAYER_SYM, QUANT_PER_CHANNEL_SYM = 0, 2              # rknn_matmul_quant_type
CORE_MASKS = {"auto": 0, "core0": 1, "core1": 2, "core2": 4, "core0_1": 3, "core0_1_2": 7, "all": 0xFFFF}
TENSOR_TYPES = {0: "fp32", 1: "fp16", 2: "int8", 3: "uint8", 4: "int16", 5: "uint16", 6: "int32",
                7: "uint32", 8: "int64", 9: "bool", 10: "int4", 11: "bf16"}
MEM_SYNC_TO_DEVICE, MEM_SYNC_FROM_DEVICE = 1, 2               # rknn_mem_sync modes [§4.1]

ERROR_NAMES = {
    -1: "execute failed", -2: "execute timeout", -3: "device is unavailable",
    -4: "memory malloc fail", -5: "parameter is invalid", -6: "model is invalid",
    -7: "context is invalid", -8: "input is invalid", -9: "output is invalid",
}
MAX_NAME_LEN = 256  # RKNN_MAX_NAME_LEN [docs/rknn-toolkit.md §4.3]
MAX_DIMS = 16       # RKNN_MAX_DIMS


# --- structs [docs/rknn-toolkit.md §4.3] ----------------------------------------------------
class MatmulInfo(ctypes.Structure):
    _fields_ = [
        ("M", ctypes.c_int32), ("K", ctypes.c_int32), ("N", ctypes.c_int32),
        ("type", ctypes.c_int32),
        ("B_layout", ctypes.c_int16), ("B_quant_type", ctypes.c_int16),
        ("AC_layout", ctypes.c_int16), ("AC_quant_type", ctypes.c_int16),
        ("iommu_domain_id", ctypes.c_int32),
        ("group_size", ctypes.c_int16),
        ("reserved", ctypes.c_int8 * 34),
    ]


class MatmulTensorAttr(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * MAX_NAME_LEN),
        ("n_dims", ctypes.c_uint32),
        ("dims", ctypes.c_uint32 * MAX_DIMS),
        ("size", ctypes.c_uint32),
        ("type", ctypes.c_int32),
    ]

    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.dims[: self.n_dims])


class MatmulIoAttr(ctypes.Structure):
    _fields_ = [("A", MatmulTensorAttr), ("B", MatmulTensorAttr), ("C", MatmulTensorAttr)]


class MatmulShape(ctypes.Structure):
    _fields_ = [("M", ctypes.c_int32), ("K", ctypes.c_int32), ("N", ctypes.c_int32)]


class QuantParams(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * MAX_NAME_LEN),
        ("scale", ctypes.POINTER(ctypes.c_float)),
        ("scale_len", ctypes.c_int32),
        ("zp", ctypes.POINTER(ctypes.c_int32)),
        ("zp_len", ctypes.c_int32),
    ]


class TensorMem(ctypes.Structure):
    _fields_ = [
        ("virt_addr", ctypes.c_void_p),
        ("phys_addr", ctypes.c_uint64),
        ("fd", ctypes.c_int32),
        ("offset", ctypes.c_int32),
        ("size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("priv_data", ctypes.c_void_p),
    ]


_LAYOUT = {
    MatmulInfo: (64, {"M": 0, "K": 4, "N": 8, "type": 12, "B_layout": 16, "B_quant_type": 18,
                      "AC_layout": 20, "AC_quant_type": 22, "iommu_domain_id": 24,
                      "group_size": 28, "reserved": 30}),
    MatmulTensorAttr: (332, {"name": 0, "n_dims": 256, "dims": 260, "size": 324, "type": 328}),
    MatmulIoAttr: (996, {"A": 0, "B": 332, "C": 664}),
    MatmulShape: (12, {"M": 0, "K": 4, "N": 8}),
    QuantParams: (288, {"name": 0, "scale": 256, "scale_len": 264, "zp": 272, "zp_len": 280}),
    TensorMem: (40, {"virt_addr": 0, "phys_addr": 8, "fd": 16, "offset": 20, "size": 24,
                     "flags": 28, "priv_data": 32}),
}
if ctypes.sizeof(ctypes.c_void_p) == 8:  # the documented layouts are LP64 (aarch64)
    for _struct, (_size, _offsets) in _LAYOUT.items():
        assert ctypes.sizeof(_struct) == _size, (_struct.__name__, ctypes.sizeof(_struct))
        for _name, _off in _offsets.items():
            assert getattr(_struct, _name).offset == _off, (_struct.__name__, _name)

Context = ctypes.c_uint64  # rknn_matmul_ctx = rknn_context, a u64 on aarch64 [§4.1]


# --- errors and loading ------------------------------------------------------------------
class RknnError(Exception):
    """A librknnrt call failed. ``code`` is its negative return value."""

    def __init__(self, func: str, code: int, hint: str = "") -> None:
        meaning = ERROR_NAMES.get(code, "unknown error")
        super().__init__(f"{func} returned {code} ({meaning}){': ' + hint if hint else ''}")
        self.func = func
        self.code = code


class RknnUnavailable(RuntimeError):
    """librknnrt.so is not installed (or lacks the matmul API)."""


STANDIN_MARKER = "ggml_rknpu_rknn_standin"   # exported only by tests/rknn_standin (never by librknnrt)
SEARCH_DIRS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/lib/aarch64-linux-gnu",
               "/lib", "/lib/aarch64-linux-gnu")
LIBRARY_NAME = "librknnrt.so"


def find_library(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$LIBRKNNRT_PATH``, else ``librknnrt.so`` in the usual directories."""
    candidates = [Path(path)] if path else []
    env = os.environ.get("LIBRKNNRT_PATH")
    if env and not path:
        candidates.append(Path(env))
    if not candidates:
        candidates = [Path(d) / LIBRARY_NAME for d in SEARCH_DIRS]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise RknnUnavailable(
        f"{LIBRARY_NAME} not found (looked at {', '.join(str(c) for c in candidates)}). "
        "It is Rockchip's closed runtime and is not shipped with ggml-rknpu: install it from "
        "airockchip/rknn-toolkit2 (rknpu2/runtime/Linux/librknn_api/aarch64/librknnrt.so) "
        "and/or set LIBRKNNRT_PATH to its full path.")


_P = ctypes.POINTER
TensorMemP: TypeAlias = "ctypes._Pointer[TensorMem]"   # what rknn_create_mem returns
_SIGNATURES = {
    "rknn_matmul_create": (ctypes.c_int, [_P(Context), _P(MatmulInfo), _P(MatmulIoAttr)]),
    "rknn_matmul_create_dynamic_shape": (ctypes.c_int, [_P(Context), _P(MatmulInfo), ctypes.c_int,
                                                        _P(MatmulShape), _P(MatmulIoAttr)]),
    "rknn_matmul_set_dynamic_shape": (ctypes.c_int, [Context, _P(MatmulShape)]),
    "rknn_matmul_set_io_mem": (ctypes.c_int, [Context, _P(TensorMem), _P(MatmulTensorAttr)]),
    "rknn_matmul_set_core_mask": (ctypes.c_int, [Context, ctypes.c_int]),
    "rknn_matmul_set_quant_params": (ctypes.c_int, [Context, _P(QuantParams)]),
    "rknn_matmul_run": (ctypes.c_int, [Context]),
    "rknn_matmul_destroy": (ctypes.c_int, [Context]),
    "rknn_B_normal_layout_to_native_layout": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p,
                                                             ctypes.c_int, ctypes.c_int, _P(MatmulInfo)]),
    "rknn_create_mem": (_P(TensorMem), [Context, ctypes.c_uint32]),
    "rknn_destroy_mem": (ctypes.c_int, [Context, _P(TensorMem)]),
    "rknn_mem_sync": (ctypes.c_int, [Context, _P(TensorMem), ctypes.c_int]),
}


class RknnLibrary:
    """The loaded library with typed, checked calls (raise ``RknnError`` on a negative code)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = find_library(path)
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise RknnUnavailable(f"cannot load {self.path}: {exc}") from exc
        missing = [name for name in _SIGNATURES if not hasattr(self._lib, name)]
        if missing:
            raise RknnUnavailable(f"{self.path} lacks {', '.join(missing)}; it is not a librknnrt "
                                  "with the matmul API (v1.5+)")
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    @property
    def is_standin(self) -> bool:
        """True for the test stand-in (it exports ``STANDIN_MARKER``): nothing it does is the NPU."""
        return hasattr(self._lib, STANDIN_MARKER)

    def _call(self, name: str, *args, hint: str = "") -> int:
        ret = getattr(self._lib, name)(*args)
        if ret < 0:
            raise RknnError(name, ret, hint)
        return ret

    # -- contexts --------------------------------------------------------------------
    def matmul_create(self, info: MatmulInfo) -> tuple[int, MatmulIoAttr]:
        ctx, io = Context(0), MatmulIoAttr()
        self._call("rknn_matmul_create", ctypes.byref(ctx), ctypes.byref(info), ctypes.byref(io),
                   hint=f"M={info.M} K={info.K} N={info.N} type={MATMUL_TYPES.get(info.type, info.type)}")
        return ctx.value, io

    def matmul_create_dynamic_shape(self, info: MatmulInfo, shapes: Sequence[tuple[int, int, int]]
                                    ) -> tuple[int, list[MatmulIoAttr]]:
        if not shapes:
            raise ValueError("at least one shape is needed")
        arr = (MatmulShape * len(shapes))(*[MatmulShape(*s) for s in shapes])
        ios = (MatmulIoAttr * len(shapes))()
        ctx = Context(0)
        self._call("rknn_matmul_create_dynamic_shape", ctypes.byref(ctx), ctypes.byref(info),
                   len(shapes), arr, ios)
        return ctx.value, list(ios)

    def matmul_set_dynamic_shape(self, ctx: int, shape: tuple[int, int, int]) -> None:
        self._call("rknn_matmul_set_dynamic_shape", ctx, ctypes.byref(MatmulShape(*shape)),
                   hint=f"shape {shape} was not declared at create")

    def matmul_set_core_mask(self, ctx: int, mask: int) -> None:
        self._call("rknn_matmul_set_core_mask", ctx, mask)

    def matmul_set_quant_params(self, ctx: int, name: bytes, scale: np.ndarray, zp: np.ndarray) -> None:
        """Per-layer (len 1) or per-channel (len N) params for tensor ``name`` (b"A"/b"B"/b"C")."""
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        zp = np.ascontiguousarray(zp, dtype=np.int32)
        params = QuantParams(name=name, scale=scale.ctypes.data_as(_P(ctypes.c_float)),
                             scale_len=scale.size, zp=zp.ctypes.data_as(_P(ctypes.c_int32)), zp_len=zp.size)
        self._call("rknn_matmul_set_quant_params", ctx, ctypes.byref(params))

    def matmul_set_io_mem(self, ctx: int, mem: TensorMemP, attr: MatmulTensorAttr) -> None:
        self._call("rknn_matmul_set_io_mem", ctx, mem, ctypes.byref(attr),
                   hint=f"tensor {attr.name.decode()} needs {attr.size} bytes")

    def matmul_run(self, ctx: int) -> None:
        self._call("rknn_matmul_run", ctx)

    def matmul_destroy(self, ctx: int) -> None:
        self._call("rknn_matmul_destroy", ctx)

    # -- memory ----------------------------------------------------------------------
    def create_mem(self, ctx: int, size: int) -> TensorMemP:
        mem = self._lib.rknn_create_mem(ctx, size)
        if not mem:
            raise RknnError("rknn_create_mem", -4, f"{size} bytes; NPU memory exhausted?")
        return mem

    def destroy_mem(self, ctx: int, mem: TensorMemP) -> None:
        self._call("rknn_destroy_mem", ctx, mem)

    def mem_sync(self, ctx: int, mem: TensorMemP, mode: int) -> None:
        self._call("rknn_mem_sync", ctx, mem, mode)

    @staticmethod
    def mem_array(mem: TensorMemP, dtype: npt.DTypeLike, count: int) -> np.ndarray:
        """A numpy view of ``count`` elements of the buffer's CPU mapping."""
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > mem.contents.size:
            raise ValueError(f"view of {nbytes} bytes exceeds the {mem.contents.size}-byte buffer")
        raw = (ctypes.c_uint8 * nbytes).from_address(mem.contents.virt_addr)
        # numpy's stubs take a Buffer only on Python >= 3.12; a ctypes array is one on every version
        return np.frombuffer(raw, dtype=dtype, count=count)  # type: ignore[call-overload]

    # -- layouts ---------------------------------------------------------------------
    def b_normal_to_native(self, b_kn: np.ndarray, info: MatmulInfo, native_bytes: int) -> np.ndarray:
        """B [K, N] row-major (``B_layout`` normal) -> the runtime's native layout bytes.
        Header form with 5 arguments [docs/rknn-toolkit.md §4.1: trust the header of your version]."""
        b_kn = np.ascontiguousarray(b_kn)
        out = np.zeros(native_bytes, dtype=np.uint8)
        K, N = b_kn.shape
        self._call("rknn_B_normal_layout_to_native_layout", b_kn.ctypes.data_as(ctypes.c_void_p),
                   out.ctypes.data_as(ctypes.c_void_p), K, N, ctypes.byref(info))
        return out
