"""The pinned ggml, loaded through ctypes: libggml-base, then libggml-cpu, ABI checked at load.

Invariants: both libraries come from the first directory that has them
(``toolchain.llamacpp.ggml_library_dir``), base loaded with ``RTLD_GLOBAL`` first; nothing
uses the library before :func:`check_abi` has compared the generated struct layouts
(``abi.py``) and enums (``libggml/enums.py``) with it: sizes, every field of a ggml-made tensor
read back, the plan and threadpool fields, each op's and type's name and sizes. A mismatch
raises :class:`GgmlAbiError` naming the fix. Why ggml itself: docs/server.md "Host backend"."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import TYPE_NAMES, TYPE_TRAITS, GgmlGluOp, GgmlOp, GgmlType, GgmlUnaryOp
from ggml_rknpu.libggml.log import GgmlLog, LogCallback
from ggml_rknpu.toolchain import llamacpp

LIB_DIR_ENV = llamacpp.GGML_LIB_DIR_ENV
_FIX = ("rebuild the pinned libraries (scripts/build-llama-cpp, or scripts/build-ggml where only the server "
        "runs), regenerate the bindings "
        "(scripts/gen-ggml-abi, scripts/gen-ggml-enums) and restart")

if TYPE_CHECKING:   # the classes the factories below make, under names mypy can use as types
    TensorP: TypeAlias = ctypes._Pointer[abi.Tensor]
    ToFloat: TypeAlias = ctypes._CFunctionType
    FromFloat: TypeAlias = ctypes._CFunctionType
else:
    TensorP = ctypes.POINTER(abi.Tensor)
    ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    FromFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
GraphComputeRaw = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)   # ggml_graph_compute

GGML_STATUS_SUCCESS = 0  # enum ggml_status (ggml.h): ggml_graph_compute's result when all went well


class GgmlLibraryMissing(FileNotFoundError):
    """libggml-base / libggml-cpu are not built yet."""


class GgmlAbiError(RuntimeError):
    """The loaded ggml does not match the binding's generated layouts and enums."""


def library_dir() -> Path:
    """Where :func:`load` takes the libraries from (lookup order: ``toolchain.llamacpp``)."""
    try:
        return llamacpp.ggml_library_dir()
    except llamacpp.LlamaCppNotBuilt as exc:
        raise GgmlLibraryMissing(str(exc)) from None


# name -> (restype, argtypes); c_void_p stands for opaque ggml pointers (context, graph, ...)
_VP, _SZ, _I, _I64, _B = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int64, ctypes.c_bool
_BASE_FUNCS: dict[str, tuple] = {
    "ggml_init": (_VP, [abi.InitParams]),
    "ggml_free": (None, [_VP]),
    "ggml_tensor_overhead": (_SZ, []),
    "ggml_get_mem_size": (_SZ, [_VP]),
    "ggml_graph_overhead_custom": (_SZ, [_SZ, _B]),
    "ggml_new_tensor": (TensorP, [_VP, _I, _I, ctypes.POINTER(_I64)]),
    "ggml_new_graph_custom": (_VP, [_VP, _SZ, _B]),
    "ggml_graph_add_node": (None, [_VP, TensorP]),
    "ggml_graph_n_nodes": (_I, [_VP]),
    "ggml_nbytes": (_SZ, [TensorP]),
    "ggml_set_name": (TensorP, [TensorP, ctypes.c_char_p]),
    "ggml_get_name": (ctypes.c_char_p, [TensorP]),
    "ggml_get_data": (_VP, [TensorP]),
    "ggml_set_input": (None, [TensorP]),
    "ggml_add": (TensorP, [_VP, TensorP, TensorP]),
    "ggml_scale": (TensorP, [_VP, TensorP, ctypes.c_float]),
    "ggml_view_1d": (TensorP, [_VP, TensorP, _I64, _SZ]),
    "ggml_op_name": (ctypes.c_char_p, [_I]),
    "ggml_unary_op_name": (ctypes.c_char_p, [_I]),
    "ggml_glu_op_name": (ctypes.c_char_p, [_I]),
    "ggml_get_type_traits": (ctypes.POINTER(abi.TypeTraits), [_I]),
    "ggml_threadpool_params_init": (None, [ctypes.POINTER(abi.ThreadpoolParams), _I]),
    # ggml-quants.h (GGML_API): Q8_K, ggml-cpu's activation type for the k-quants, has no to_float trait
    "dequantize_row_q8_K": (None, [_VP, _VP, _I64]),
    "ggml_log_set": (None, [LogCallback, _VP]),
    # ggml-backend.h: buffers of a buffer type (ggml-cpu's CPU_REPACK extra buffer, ``libggml.repack``)
    "ggml_backend_reg_get_proc_address": (_VP, [_VP, ctypes.c_char_p]),
    "ggml_backend_buft_name": (ctypes.c_char_p, [_VP]),
    "ggml_backend_buft_get_alloc_size": (_SZ, [_VP, TensorP]),
    "ggml_backend_buft_alloc_buffer": (_VP, [_VP, _SZ]),
    "ggml_backend_buffer_get_base": (_VP, [_VP]),
    "ggml_backend_buffer_free": (None, [_VP]),
    "ggml_backend_tensor_alloc": (_I, [_VP, TensorP, _VP]),
    "ggml_backend_tensor_set": (None, [TensorP, _VP, _SZ, _SZ]),
}
_CPU_FUNCS: dict[str, tuple] = {
    "ggml_cpu_init": (None, []),
    "ggml_graph_plan": (abi.Cplan, [_VP, _I, _VP]),
    "ggml_graph_compute": (_I, [_VP, ctypes.POINTER(abi.Cplan)]),
    "ggml_threadpool_new": (_VP, [ctypes.POINTER(abi.ThreadpoolParams)]),
    "ggml_threadpool_free": (None, [_VP]),
    "ggml_threadpool_pause": (None, [_VP]),
    "ggml_threadpool_resume": (None, [_VP]),
    "ggml_get_type_traits_cpu": (ctypes.POINTER(abi.TypeTraitsCpu), [_I]),
    "ggml_backend_cpu_reg": (_VP, []),
    "ggml_backend_reg_dev_get": (_VP, [_VP, _SZ]),
    "ggml_backend_dev_supports_op": (_B, [_VP, TensorP]),
}


# An opaque ggml pointer (context, graph, threadpool, backend device) as ctypes passes a c_void_p:
# an int, or None for NULL.
VoidP: TypeAlias = int | None


class Ggml:
    """The loaded pinned ggml: one attribute per declared C function (``g.ggml_init(...)``).

    The annotations below are those functions as ctypes calls them (arguments it accepts,
    what its restype makes of the result); ``__init__`` binds each from the tables above."""

    ggml_init: Callable[[abi.InitParams], VoidP]
    ggml_free: Callable[[VoidP], None]
    ggml_tensor_overhead: Callable[[], int]
    ggml_get_mem_size: Callable[[VoidP], int]
    ggml_graph_overhead_custom: Callable[[int, bool], int]
    ggml_new_tensor: Callable[[VoidP, int, int, ctypes.Array[ctypes.c_int64]], TensorP]
    ggml_new_graph_custom: Callable[[VoidP, int, bool], VoidP]
    ggml_graph_add_node: Callable[[VoidP, TensorP], None]
    ggml_graph_n_nodes: Callable[[VoidP], int]
    ggml_nbytes: Callable[[TensorP], int]
    ggml_set_name: Callable[[TensorP, bytes], TensorP]
    ggml_get_name: Callable[[TensorP], bytes | None]
    ggml_get_data: Callable[[TensorP], VoidP]
    ggml_set_input: Callable[[TensorP], None]
    ggml_add: Callable[[VoidP, TensorP, TensorP], TensorP]
    ggml_scale: Callable[[VoidP, TensorP, float], TensorP]
    ggml_view_1d: Callable[[VoidP, TensorP, int, int], TensorP]
    ggml_op_name: Callable[[int], bytes | None]
    ggml_unary_op_name: Callable[[int], bytes | None]
    ggml_glu_op_name: Callable[[int], bytes | None]
    ggml_get_type_traits: Callable[[int], ctypes._Pointer[abi.TypeTraits]]
    ggml_threadpool_params_init: Callable[[ctypes._CArgObject, int], None]
    dequantize_row_q8_K: Callable[[VoidP, VoidP, int], None]
    ggml_log_set: Callable[[LogCallback, VoidP], None]
    ggml_backend_reg_get_proc_address: Callable[[VoidP, bytes], VoidP]
    ggml_backend_buft_name: Callable[[VoidP], bytes | None]
    ggml_backend_buft_get_alloc_size: Callable[[VoidP, TensorP], int]
    ggml_backend_buft_alloc_buffer: Callable[[VoidP, int], VoidP]
    ggml_backend_buffer_get_base: Callable[[VoidP], VoidP]
    ggml_backend_buffer_free: Callable[[VoidP], None]
    ggml_backend_tensor_alloc: Callable[[VoidP, TensorP, VoidP], int]
    ggml_backend_tensor_set: Callable[[TensorP, VoidP, int, int], None]
    ggml_cpu_init: Callable[[], None]
    ggml_graph_plan: Callable[[VoidP, int, VoidP], abi.Cplan]
    ggml_graph_compute: Callable[[VoidP, ctypes._CArgObject], int]
    ggml_threadpool_new: Callable[[ctypes._CArgObject], VoidP]
    ggml_threadpool_free: Callable[[VoidP], None]
    ggml_threadpool_pause: Callable[[VoidP], None]
    ggml_threadpool_resume: Callable[[VoidP], None]
    ggml_get_type_traits_cpu: Callable[[int], ctypes._Pointer[abi.TypeTraitsCpu]]
    ggml_backend_cpu_reg: Callable[[], VoidP]
    ggml_backend_reg_dev_get: Callable[[VoidP, int], VoidP]
    ggml_backend_dev_supports_op: Callable[[VoidP, TensorP], bool]

    def __init__(self, lib_dir: Path) -> None:
        base, cpu = lib_dir / "libggml-base.so", lib_dir / "libggml-cpu.so"
        for path in (base, cpu):
            if not path.is_file():
                raise GgmlLibraryMissing(f"{path} not found: {llamacpp.GGML_HINT}")
        self.lib_dir = lib_dir
        # OpenMP workers (the pinned build's threading) sleep between graphs instead of spinning;
        # libgomp reads this once, when libggml-cpu pulls it in. A user's own setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.base = ctypes.CDLL(str(base.resolve()), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(cpu.resolve()), mode=ctypes.RTLD_GLOBAL)
        for lib, path, table in ((self.base, base, _BASE_FUNCS), (self.cpu, cpu, _CPU_FUNCS)):
            for name, (restype, argtypes) in table.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError as exc:
                    raise GgmlAbiError(f"{path.resolve()} has no {name}: {_FIX}") from exc
                fn.restype, fn.argtypes = restype, argtypes
                setattr(self, name, fn)
        # the replay's hot call (hundreds of segments per token): a prototype of plain pointers, called
        # with the graph's and the cplan's addresses as ints (no byref, no POINTER argument check)
        self.graph_compute_raw = GraphComputeRaw(_addr(self.cpu.ggml_graph_compute))
        self.log = GgmlLog()
        self.ggml_log_set(self.log.callback, None)  # ggml's messages into Python logging (libggml.log)
        self.ggml_cpu_init()                       # fp16 tables; required before any compute
        check_abi(self)
        self.cpu_device = self.ggml_backend_reg_dev_get(self.ggml_backend_cpu_reg(), 0)

    def context(self, n_tensors: int, graph_sizes: tuple[int, ...] = ()) -> int:
        """A no-alloc context with room for ``n_tensors`` tensor headers and the graphs."""
        size = n_tensors * self.ggml_tensor_overhead()
        size += sum(self.ggml_graph_overhead_custom(n, False) for n in graph_sizes) + 1024
        ctx = self.ggml_init(abi.InitParams(mem_size=size, mem_buffer=None, no_alloc=True))
        if not ctx:
            raise MemoryError(f"ggml_init of {size} bytes failed")
        return ctx

    def new_tensor(self, ctx: int, type_: int, ne: tuple[int, ...]) -> TensorP:
        dims = (ctypes.c_int64 * 4)(*ne)
        t = self.ggml_new_tensor(ctx, type_, 4, dims)
        if not t:
            raise MemoryError("ggml context out of room for tensors")
        return t

    def to_float(self, type_: int) -> ToFloat | None:
        """ggml's own dequantizer of a type (``type_traits.to_float``), or None."""
        fn = self.ggml_get_type_traits(type_).contents.to_float
        return ToFloat(fn) if fn else None

    def from_float(self, type_: int) -> FromFloat | None:
        """ggml-cpu's quantizer of a type (``type_traits_cpu.from_float``), or None."""
        fn = self.ggml_get_type_traits_cpu(type_).contents.from_float
        return FromFloat(fn) if fn else None

    def vec_dot_type(self, type_: int) -> int:
        """The type ggml-cpu converts f32 activations to before its dot products with a
        ``type_`` weight (``type_traits_cpu.vec_dot_type``, ggml-cpu.c)."""
        return int(self.ggml_get_type_traits_cpu(type_).contents.vec_dot_type)

    def supports_op(self, t: TensorP) -> bool:
        """The CPU backend's own ``supports_op`` (types with a quantizer, matmul vec_dot types...)."""
        return bool(self.ggml_backend_dev_supports_op(self.cpu_device, t))


def _addr(p: ctypes._CData) -> int:
    return ctypes.cast(p, ctypes.c_void_p).value or 0


def _expect(what: str, got: object, want: object) -> None:
    if got != want:
        raise GgmlAbiError(f"ggml ABI mismatch: {what} is {got!r}, the binding expects {want!r}: {_FIX}")


def check_abi(g: Ggml) -> None:
    """Refuse a library whose layouts or enums differ from the generated ones (see module doc)."""
    _expect("ggml_tensor_overhead()", g.ggml_tensor_overhead(),
            ctypes.sizeof(abi.Object) + ctypes.sizeof(abi.Tensor))
    for op in GgmlOp:
        _expect(f"ggml_op_name({int(op)})", (g.ggml_op_name(op) or b"").decode(), op.name)
    for unary in GgmlUnaryOp:
        _expect(f"ggml_unary_op_name({int(unary)})", (g.ggml_unary_op_name(unary) or b"").decode(), unary.name)
    for glu in GgmlGluOp:
        _expect(f"ggml_glu_op_name({int(glu)})", (g.ggml_glu_op_name(glu) or b"").decode(), glu.name)
    for t in GgmlType:
        tr = g.ggml_get_type_traits(t).contents
        _expect(f"type_traits[{int(t)}]", ((tr.type_name or b"").decode(), tr.blck_size, tr.type_size),
                (TYPE_NAMES[t], *TYPE_TRAITS[t]))

    ctx = g.context(8, (4,))
    try:
        a = g.new_tensor(ctx, GgmlType.F16, (3, 5, 7, 11))
        b = g.new_tensor(ctx, GgmlType.F16, (3, 5, 7, 11))
        ta = a.contents
        _expect("tensor spacing in a context", _addr(b) - _addr(a), g.ggml_tensor_overhead())
        _expect("ggml_tensor.type", ta.type, GgmlType.F16)
        _expect("ggml_tensor.ne", tuple(ta.ne), (3, 5, 7, 11))
        _expect("ggml_tensor.nb", tuple(ta.nb), (2, 6, 30, 210))
        _expect("ggml_nbytes", g.ggml_nbytes(a), 2310)
        g.ggml_set_name(a, b"abi-check")
        _expect("ggml_tensor.name", ta.name, b"abi-check")
        ta.data = 0x1000
        _expect("ggml_tensor.data", g.ggml_get_data(a), 0x1000)
        ta.data = None
        g.ggml_set_input(a)
        _expect("ggml_tensor.flags", ta.flags, abi.GGML_TENSOR_FLAG_INPUT)
        add = g.ggml_add(ctx, a, b)
        c = add.contents
        _expect("ggml_tensor.op", c.op, GgmlOp.ADD)
        _expect("ggml_tensor.src", (_addr(c.src[0]), _addr(c.src[1]), _addr(c.src[2])), (_addr(a), _addr(b), 0))
        v = g.ggml_view_1d(ctx, a, 4, 6).contents
        _expect("ggml_tensor.view_src/view_offs", (_addr(v.view_src), v.view_offs), (_addr(a), 6))
        f = g.new_tensor(ctx, GgmlType.F32, (4, 1, 1, 1))
        s = g.ggml_scale(ctx, f, 2.5)
        op_params = ctypes.cast(s.contents.op_params, ctypes.POINTER(ctypes.c_float))
        _expect("ggml_tensor.op_params", (s.contents.op, op_params[0]), (GgmlOp.SCALE, 2.5))
        graph = g.ggml_new_graph_custom(ctx, 4, False)
        c.flags |= abi.GGML_TENSOR_FLAG_COMPUTE         # ADD runs on every thread (ggml_get_n_tasks)
        g.ggml_graph_add_node(graph, add)
        _expect("ggml_graph_n_nodes", g.ggml_graph_n_nodes(graph), 1)
        plan = g.ggml_graph_plan(graph, 3, None)
        _expect("ggml_cplan.n_threads/threadpool/use_ref", (plan.n_threads, plan.threadpool, plan.use_ref),
                (3, None, False))
    finally:
        g.ggml_free(ctx)
    params = abi.ThreadpoolParams()
    g.ggml_threadpool_params_init(ctypes.byref(params), 3)
    _expect("ggml_threadpool_params.n_threads", params.n_threads, 3)


_LOADED: Ggml | None = None


def load() -> Ggml:
    """The process-wide binding (loaded and checked once)."""
    global _LOADED
    if _LOADED is None:
        _LOADED = Ggml(library_dir())
    return _LOADED
