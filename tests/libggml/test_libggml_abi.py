"""The ctypes binding of the pinned ggml: generated layouts, the load-time ABI check."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ggml_rknpu.codegen import ggml_abi as gen_abi
from ggml_rknpu.libggml import abi, lib
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.toolchain import llamacpp


def test_generated_abi_is_current():
    try:
        src = llamacpp.source_dir()
    except llamacpp.LlamaCppNotBuilt as exc:
        pytest.skip(str(exc))
    assert gen_abi.render(src) == gen_abi.OUTPUT.read_text(), "run scripts/gen-ggml-abi"


def test_parse_struct_arrays_pointers_and_refusals():
    text = """
    struct demo {
        int64_t ne[GGML_MAX_DIMS]; // comment
        int32_t op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
        struct ggml_tensor * src[GGML_MAX_SRC];
        const char * name;
        enum ggml_type type;
    };"""
    defines = {"GGML_MAX_DIMS": 4, "GGML_MAX_OP_PARAMS": 64, "GGML_MAX_SRC": 10}
    assert gen_abi.parse_struct(text, "demo", defines) == [
        ("ne", "ctypes.c_int64 * 4"), ("op_params", "ctypes.c_int32 * 16"),
        ("src", "ctypes.c_void_p * 10"), ("name", "ctypes.c_char_p"), ("type", "ctypes.c_int")]
    with pytest.raises(gen_abi.GenerationError, match="not understood"):
        gen_abi.parse_struct("struct bad {\n    long double x;\n};", "bad", defines)


def test_layout_matches_the_loaded_library(host_ggml):
    assert host_ggml.ggml_tensor_overhead() == ctypes.sizeof(abi.Object) + ctypes.sizeof(abi.Tensor)
    assert ctypes.sizeof(abi.Tensor) == 336     # sanity for 64-bit hosts (ggml.h: GGML_TENSOR_SIZE)


def test_every_bound_function_is_declared_with_its_type():
    """The binding's type annotations name exactly the C functions it binds, so none is
    called untyped and none is typed but never bound."""
    assert set(lib.Ggml.__annotations__) == set(lib._BASE_FUNCS) | set(lib._CPU_FUNCS)
    for name, (_restype, argtypes) in (lib._BASE_FUNCS | lib._CPU_FUNCS).items():
        declared = lib.Ggml.__annotations__[name]
        params = declared.removeprefix("Callable[[").split("]")[0]
        assert len([p for p in params.split(", ") if p]) == len(argtypes), f"{name}: {declared}"


class _WrongOpNames:
    """The real binding, except that one op has another name (a library of another version)."""

    def __init__(self, g):
        self._g = g

    def __getattr__(self, name):
        return getattr(self._g, name)

    def ggml_op_name(self, op):
        return b"SOMETHING_ELSE" if op == GgmlOp.ROPE else self._g.ggml_op_name(op)


class _WrongOverhead(_WrongOpNames):
    def ggml_tensor_overhead(self):
        return self._g.ggml_tensor_overhead() + 16


@pytest.mark.parametrize("fake, what", [(_WrongOpNames, "ggml_op_name"), (_WrongOverhead, "ggml_tensor_overhead")])
def test_mismatch_refuses_with_the_fix(host_ggml, fake, what):
    with pytest.raises(lib.GgmlAbiError, match=f"{what}.*scripts/build-llama-cpp"):
        lib.check_abi(fake(host_ggml))


def test_missing_library_names_the_build(tmp_path):
    with pytest.raises(lib.GgmlLibraryMissing, match="scripts/build-ggml"):
        lib.Ggml(tmp_path)


def test_ggml_dequantizer_round_trip(host_ggml):
    """to_float / from_float are ggml's own (q8_0: 32 values per 34-byte block)."""
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    q = np.zeros(2 * 34, dtype=np.uint8)
    host_ggml.from_float(GgmlType.Q8_0)(x.ctypes.data, q.ctypes.data, 64)
    y = np.zeros(64, dtype=np.float32)
    host_ggml.to_float(GgmlType.Q8_0)(q.ctypes.data, y.ctypes.data, 64)
    assert np.abs(y - x).max() < 1 / 127 and np.abs(y - x).max() > 0
