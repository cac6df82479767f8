"""The librknnrt binding and the rknn engine, exercised through a C stand-in library
(tests/rknn_standin/rknn_standin.c, built here with gcc) that implements the same symbols
with the documented semantics. The vendor engine itself is validated only through this
stand-in until a board reports."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler import layout
from ggml_rknpu.rknn import binding as rb
from ggml_rknpu.rknn.engine import RknnEngine, RknnUnsupportedType, check_type
from support.rknn_support import build_so as _gcc
from support.rknn_support import standin_path  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="session")
def lib(standin_path) -> rb.RknnLibrary:
    return rb.RknnLibrary(standin_path)


def _live(lib) -> tuple[int, int]:
    return lib._lib.standin_live_contexts(), lib._lib.standin_live_mems()


# --- binding ------------------------------------------------------------------------------
def test_struct_layouts_match_the_documented_table():
    """[rknn-toolkit.md §4.3]; the stand-in's _Static_asserts check the same sizes in C."""
    assert [ctypes.sizeof(s) for s in (rb.MatmulInfo, rb.MatmulTensorAttr, rb.MatmulIoAttr,
                                       rb.MatmulShape, rb.QuantParams, rb.TensorMem)] == [64, 332, 996, 12, 288, 40]
    assert rb.MatmulInfo.group_size.offset == 28 and rb.MatmulInfo.reserved.offset == 30
    assert rb.QuantParams.zp.offset == 272 and rb.TensorMem.priv_data.offset == 32


def test_missing_library_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.delenv("LIBRKNNRT_PATH", raising=False)
    monkeypatch.setattr(rb, "SEARCH_DIRS", (str(tmp_path),))
    with pytest.raises(rb.RknnUnavailable, match="LIBRKNNRT_PATH"):
        rb.RknnLibrary()
    monkeypatch.setenv("LIBRKNNRT_PATH", str(tmp_path / "nope.so"))
    with pytest.raises(rb.RknnUnavailable, match="nope.so"):
        rb.find_library()


def test_library_found_through_env(monkeypatch, standin_path):
    monkeypatch.setenv("LIBRKNNRT_PATH", str(standin_path))
    assert rb.find_library() == standin_path


def test_library_without_the_matmul_api_is_refused(tmp_path):
    src = tmp_path / "other.c"
    src.write_text("int rknn_matmul_run(unsigned long ctx) { return 0; }\n")
    with pytest.raises(rb.RknnUnavailable, match="rknn_matmul_create"):
        rb.RknnLibrary(_gcc(tmp_path, src, "libother.so"))


def test_create_reports_native_shapes(lib):
    ctx, io = lib.matmul_create(rb.MatmulInfo(M=4, K=64, N=32, type=1, B_layout=1))
    assert (io.A.shape(), io.B.shape(), io.C.shape()) == ((4, 64), (2, 2, 16, 32), (4, 32))
    assert (io.A.size, io.B.size, io.C.size) == (4 * 64 * 2, 64 * 32 * 2, 4 * 32 * 4)
    assert io.B.name == b"B" and io.C.type == 0
    lib.matmul_destroy(ctx)
    ctx, io = lib.matmul_create(rb.MatmulInfo(M=5, K=64, N=64, type=2, B_layout=1, AC_layout=1))
    assert (io.A.shape(), io.B.shape(), io.C.shape()) == ((4, 5, 16), (2, 2, 32, 32), (16, 5, 4))
    lib.matmul_destroy(ctx)


@pytest.mark.parametrize("dtype, mtype", [("fp16", 1), ("int8", 2)])
def test_runtime_b_layout_equals_our_compiler_layout(lib, dtype, mtype):
    """Two independent writings of the native B layout agree [§4.4 vs npu-programming.md §6]."""
    rng = np.random.default_rng(1)
    K, N = 96, 64
    b_nk = (rng.standard_normal((N, K)).astype(np.float16) if dtype == "fp16"
            else rng.integers(-128, 128, (N, K), dtype=np.int8))
    native = lib.b_normal_to_native(b_nk.T.copy(), rb.MatmulInfo(M=1, K=K, N=N, type=mtype), b_nk.nbytes)
    ours = layout.pack_b(b_nk, dtype)
    assert np.array_equal(native, np.ascontiguousarray(ours).reshape(-1).view(np.uint8))


def _run_once(lib, info, a, b_native, c_dtype, c_count):
    ctx, io = lib.matmul_create(info)
    mems = [lib.create_mem(ctx, attr.size) for attr in (io.A, io.B, io.C)]
    for mem, attr in zip(mems, (io.A, io.B, io.C)):
        lib.matmul_set_io_mem(ctx, mem, attr)
    lib.mem_array(mems[0], np.uint8, a.nbytes)[:] = a.reshape(-1).view(np.uint8)
    lib.mem_array(mems[1], np.uint8, b_native.nbytes)[:] = b_native
    lib.matmul_run(ctx)
    c = lib.mem_array(mems[2], c_dtype, c_count).copy()
    for mem in mems:
        lib.destroy_mem(ctx, mem)
    lib.matmul_destroy(ctx)
    return c


def test_int8_run_through_the_binding_is_exact(lib):
    rng = np.random.default_rng(2)
    M, K, N = 3, 64, 32
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    b = rng.integers(-128, 128, (N, K), dtype=np.int8)
    info = rb.MatmulInfo(M=M, K=K, N=N, type=2, B_layout=1)
    native = lib.b_normal_to_native(b.T.copy(), info, b.nbytes)
    c = _run_once(lib, info, a, native, np.int32, M * N).reshape(M, N)
    np.testing.assert_array_equal(c, a.astype(np.int32) @ b.astype(np.int32).T)


def test_dynamic_shape_context(lib):
    info = rb.MatmulInfo(type=1, B_layout=1)
    ctx, ios = lib.matmul_create_dynamic_shape(info, [(1, 64, 32), (8, 64, 32)])
    assert [io.A.shape() for io in ios] == [(1, 64), (8, 64)]
    lib.matmul_set_dynamic_shape(ctx, (8, 64, 32))
    with pytest.raises(rb.RknnError, match=r"-5 \(parameter is invalid\).*not declared"):
        lib.matmul_set_dynamic_shape(ctx, (4, 64, 32))
    lib.matmul_destroy(ctx)


@pytest.mark.parametrize("info, code", [
    (dict(M=4, K=100, N=32, type=1), -5),            # K not a multiple of 32 [§4.4]
    (dict(M=4, K=64, N=24, type=1), -5),             # fp16 N % 16
    (dict(M=4, K=64, N=48, type=2), -5),             # int8 N % 32
    (dict(M=4, K=10272, N=32, type=1), -5),          # K > 10240
    (dict(M=4, K=64, N=32, type=5), -5),             # fp16 x int8: unsupported on RK3588 (seed M8)
])
def test_create_errors(lib, info, code):
    with pytest.raises(rb.RknnError) as exc:
        lib.matmul_create(rb.MatmulInfo(**info))
    assert exc.value.code == code and exc.value.func == "rknn_matmul_create"


def test_lifetime_errors(lib):
    ctx, io = lib.matmul_create(rb.MatmulInfo(M=4, K=64, N=32, type=1, B_layout=1))
    small = lib.create_mem(ctx, 16)
    with pytest.raises(rb.RknnError, match="needs 512 bytes"):
        lib.matmul_set_io_mem(ctx, small, io.A)
    with pytest.raises(rb.RknnError, match="-5"):
        lib.matmul_run(ctx)                                   # nothing bound
    with pytest.raises(rb.RknnError, match="-5"):
        lib.matmul_set_core_mask(ctx, 5)
    lib.matmul_set_core_mask(ctx, rb.CORE_MASKS["core0_1_2"])
    lib.matmul_set_quant_params(ctx, b"B", np.ones(32), np.zeros(32))
    with pytest.raises(rb.RknnError, match="-5"):
        lib.matmul_set_quant_params(ctx, b"B", np.ones(3), np.zeros(3))
    lib.destroy_mem(ctx, small)
    lib.matmul_destroy(ctx)
    with pytest.raises(rb.RknnError, match=r"-7 \(context is invalid\)"):
        lib.matmul_run(ctx)
    with pytest.raises(rb.RknnError, match="-7"):
        lib.matmul_destroy(ctx)


def test_mem_array_is_bounded(lib):
    ctx, _io = lib.matmul_create(rb.MatmulInfo(M=1, K=32, N=16, type=1))
    mem = lib.create_mem(ctx, 64)
    with pytest.raises(ValueError, match="exceeds"):
        lib.mem_array(mem, np.float32, 17)
    lib.destroy_mem(ctx, mem)
    lib.matmul_destroy(ctx)


# --- engine -------------------------------------------------------------------------------
@pytest.fixture
def npu(lib):
    engine = RknnEngine(lib, max_contexts=4)
    yield engine
    engine.close()


@pytest.mark.parametrize("M, K, N", [(1, 64, 16), (3, 100, 1001), (17, 9000, 40), (70, 32, 33)])
def test_engine_fp16_within_fp32_accumulation_bound(npu, M, K, N):
    rng = np.random.default_rng(M + K + N)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    c = npu.matmul(a, npu.upload_weight(b))
    a16, b16 = a.astype(np.float16).astype(np.float64), b.astype(np.float16).astype(np.float64)
    bound = 1.01 * (K + 1) * 2.0**-24 * (np.abs(a16) @ np.abs(b16).T)   # see test_engine_matmul.py
    assert c.shape == (M, N) and c.dtype == np.float32
    assert (np.abs(c - a16 @ b16.T) <= bound).all()


@pytest.mark.parametrize("M, K, N", [(1, 32, 32), (5, 100, 1001), (9, 10000, 7)])
def test_engine_int8_exact(npu, M, K, N):
    rng = np.random.default_rng(K)
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    b = rng.integers(-128, 128, (N, K), dtype=np.int8)
    c = npu.matmul(a, npu.upload_weight(b, "int8"))
    assert c.dtype == np.int32
    np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64).T)


def test_engine_int8_weight_with_float_activations(npu):
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((8, 64)).astype(np.float32)
    c = npu.matmul(a, npu.upload_weight(b, "int8"))
    assert c.dtype == np.float32
    np.testing.assert_allclose(c, a @ b.T, atol=0.1 * np.abs(a).sum(1).max() / 10)


def test_context_cache_and_b_staged_once(npu):
    b = np.ones((16, 64), np.float32)
    w = npu.upload_weight(b)
    npu.matmul(np.ones((3, 64), np.float32), w)
    staged = npu.counters["b_bytes_staged"]
    for m in (3, 4, 2, 3):
        npu.matmul(np.ones((m, 64), np.float32), w)
    assert npu.counters["b_bytes_staged"] == staged + 16 * 64 * 2   # one more bucket (2)
    assert npu.counters["context_cache_hits"] == 3
    assert npu.counters["contexts_created"] == 2
    assert npu.last_timing.device_label == "modeled"


def test_lru_bounds_live_contexts(lib):
    base = _live(lib)
    with RknnEngine(lib, max_contexts=2) as npu:
        weights = [npu.upload_weight(np.full((16, 32), i + 1, np.float32)) for i in range(3)]
        for _ in range(2):
            for i, w in enumerate(weights):
                c = npu.matmul(np.ones((1, 32), np.float32), w)
                assert (c == 32 * (i + 1)).all()
                assert _live(lib)[0] - base[0] <= 2
        assert npu.counters["contexts_destroyed"] == 4
    assert _live(lib) == base                                        # close released everything


def test_runtime_context_limit_is_reported(lib, monkeypatch):
    """The seed's runtime failed past ~150 contexts; a user LRU limit above the runtime's
    real limit surfaces as a clear RknnError, not a wrong result."""
    monkeypatch.setenv("RKNN_STANDIN_MAX_CONTEXTS", str(_live(lib)[0] + 2))
    with RknnEngine(lib, max_contexts=5) as npu:
        ws = [npu.upload_weight(np.ones((16, 32), np.float32)) for _ in range(3)]
        npu.matmul(np.ones((1, 32), np.float32), ws[0])
        npu.matmul(np.ones((1, 32), np.float32), ws[1])
        with pytest.raises(rb.RknnError, match=r"rknn_matmul_run returned -1 \(execute failed\)"):
            npu.matmul(np.ones((1, 32), np.float32), ws[2])
    with RknnEngine(lib, max_contexts=2) as npu:
        ws = [npu.upload_weight(np.ones((16, 32), np.float32)) for _ in range(3)]
        assert all((npu.matmul(np.ones((1, 32), np.float32), w) == 32).all() for w in ws)


def test_free_destroys_contexts_and_memory(lib):
    base = _live(lib)
    npu = RknnEngine(lib)
    w = npu.upload_weight(np.ones((16, 9000), np.float32))          # two K chunks
    npu.matmul(np.ones((2, 9000), np.float32), w)
    assert _live(lib) == (base[0] + 2, base[1] + 6)
    assert npu.memory_budget()[0] < npu.memory_budget()[1]
    w.free()
    assert _live(lib) == base and npu.memory_budget()[0] == npu.memory_budget()[1]
    with pytest.raises(ValueError, match="freed"):
        npu.matmul(np.ones((2, 9000), np.float32), w)
    npu.close()


@pytest.mark.parametrize("mtype, match", [(5, "docs/history.md §8"), (7, "docs/history.md §8"), (9, "unverified"),
                                          (4, "unverified")])
def test_unsupported_types_are_reported_not_attempted(npu, lib, mtype, match):
    before = (_live(lib), lib._lib.standin_runs())
    with pytest.raises(RknnUnsupportedType, match=match):
        npu.upload_weight(np.ones((16, 32), np.float32), "fp16", matmul_type=mtype)
    assert (_live(lib), lib._lib.standin_runs()) == before
    check_type(1)
    check_type(2)


def test_engine_errors(npu):
    w = npu.upload_weight(np.ones((16, 32), np.float32))
    with pytest.raises(ValueError, match="shape mismatch"):
        npu.matmul(np.ones((2, 33), np.float32), w)
    with pytest.raises(ValueError, match="out='fp16'"):
        npu.matmul(np.ones((2, 32), np.float32), w, out="fp16")
    with pytest.raises(TypeError, match="upload_weight"):
        npu.matmul(np.ones((2, 32), np.float32), object())
    with pytest.raises(ValueError, match="dtype must be one of"):
        npu.upload_weight(np.ones((2, 2), np.float32), "bf16")
    with pytest.raises(ValueError, match="does not match"):
        npu.upload_weight(np.ones((2, 2), np.float32), "int8", matmul_type=1)
    with pytest.raises(ValueError, match="max_contexts"):
        RknnEngine(npu.lib, max_contexts=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(1, 300), K=st.integers(1, 9000), N=st.integers(1, 200),
       dtype=st.sampled_from(("fp16", "int8")), seed=st.integers(0, 2**16))
def test_engine_random_shapes(lib, M, K, N, dtype, seed):
    rng = np.random.default_rng(seed)
    with RknnEngine(lib, max_contexts=4) as npu:
        if dtype == "int8":
            a = rng.integers(-128, 128, (M, K), dtype=np.int8)
            b = rng.integers(-128, 128, (N, K), dtype=np.int8)
            c = npu.matmul(a, npu.upload_weight(b, "int8"))
            np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64).T)
        else:
            a = rng.standard_normal((M, K)).astype(np.float32)
            b = rng.standard_normal((N, K)).astype(np.float32)
            c = npu.matmul(a, npu.upload_weight(b))
            a16, b16 = a.astype(np.float16).astype(np.float64), b.astype(np.float16).astype(np.float64)
            bound = 1.01 * (K + 1) * 2.0**-24 * (np.abs(a16) @ np.abs(b16).T)
            assert (np.abs(c - a16 @ b16.T) <= bound).all()


def test_modeled_device_time_follows_the_core_mask(lib):
    """auto prices one core (cost/anchors.py); a 3-core mask prices three: a wide GEMV gets faster."""
    times: dict[str, float] = {}
    for mask in ("auto", "core0", "core0_1_2"):
        with RknnEngine(lib, core_mask=mask) as npu:
            npu.matmul(np.ones((1, 2048), np.float32), npu.upload_weight(np.ones((2048, 2048), np.float32)))
            timing = npu.last_timing
            assert timing is not None and timing.device_s is not None
            times[mask] = timing.device_s
    assert times["auto"] == times["core0"] and times["core0_1_2"] < 0.6 * times["core0"]
