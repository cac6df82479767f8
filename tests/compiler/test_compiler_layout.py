"""Native layouts [npu-programming.md §6]: pack/unpack against the §6 address formulas,
zero padding of unaligned K and N, K-chunked B, partial-sum unpacking."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler.layout import pack_a, pack_b, unpack_c
from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.compiler.tiling import k_chunks
from ggml_rknpu.hw.alignment import align_up

NP = {"fp16": np.float16, "int8": np.int8}


def rand(rng, shape, dtype):
    if dtype == "int8":
        return rng.integers(-128, 128, size=shape, dtype=np.int8)
    return rng.standard_normal(shape).astype(np.float16)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 300), st.sampled_from(["fp16", "int8"]), st.integers(0, 2**31))
def test_pack_a_matches_section6_formula(M, K, dtype, seed):
    rng = np.random.default_rng(seed)
    a = rand(rng, (M, K), dtype)
    packed = pack_a(a, dtype).view(NP[dtype])
    c2 = 8 if dtype == "fp16" else 16
    Kp = align_up(K, 32)
    assert packed.size == Kp * M
    m, k = np.meshgrid(np.arange(M), np.arange(K), indexing="ij")
    addr = (k // c2) * M * c2 + m * c2 + k % c2          # §6 A address
    np.testing.assert_array_equal(packed[addr], a)
    mask = np.ones(packed.size, bool)
    mask[addr.ravel()] = False
    assert not packed[mask].any()                         # K padding is zero


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 100), st.integers(1, 300), st.sampled_from(["fp16", "int8"]), st.integers(0, 2**31))
def test_pack_b_matches_section6_formula(N, K, dtype, seed):
    rng = np.random.default_rng(seed)
    b = rand(rng, (N, K), dtype)
    packed = pack_b(b, dtype).view(NP[dtype])
    g = 16 if dtype == "fp16" else 32
    Kp, Np = align_up(K, 32), align_up(N, g)
    assert packed.size == Kp * Np
    n, k = np.meshgrid(np.arange(N), np.arange(K), indexing="ij")
    addr = (n // g) * g * Kp + (k // 32) * g * 32 + (n % g) * 32 + k % 32   # §6 B address
    np.testing.assert_array_equal(packed[addr], b)
    mask = np.ones(packed.size, bool)
    mask[addr.ravel()] = False
    assert not packed[mask].any()                         # K and N padding are zero


def test_pack_b_k_chunks_are_contiguous_blocks():
    rng = np.random.default_rng(1)
    N, K = 40, 10240 + 100
    b = rand(rng, (N, K), "fp16")
    chunks = k_chunks(K, "fp16")
    assert len(chunks) >= 2 and sum(c.size for c in chunks) == align_up(K, 32)   # K > 8192: split
    packed = pack_b(b, "fp16").view(np.float16)
    Np = 48
    for ch in chunks:
        block = packed[Np * ch.k0: Np * (ch.k0 + ch.size)].reshape(Np // 16, ch.size // 32, 16, 32)
        dense = block.transpose(0, 2, 1, 3).reshape(Np, ch.size)
        ref = np.zeros((Np, ch.size), np.float16)
        real = b[:, ch.k0: ch.k0 + ch.size]
        ref[:N, : real.shape[1]] = real
        np.testing.assert_array_equal(dense, ref)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 50), st.integers(1, 90), st.sampled_from([("fp16", "fp32"), ("fp16", "fp16"), ("int8", "int32")]),
       st.integers(0, 2**31))
def test_unpack_c_inverts_the_section6_layout(M, N, mode, seed):
    dtype, out = mode
    prog = compile_matmul(M, 32, N, dtype=dtype, out=out)
    rng = np.random.default_rng(seed)
    npdt = {"fp32": np.float32, "fp16": np.float16, "int32": np.int32}[out]
    c = (rng.integers(-1000, 1000, size=(M, N))).astype(npdt)
    c2 = 8 if out == "fp16" else 4
    Np = prog.shape.Np
    buf = np.zeros(prog.c_bytes // np.dtype(npdt).itemsize, npdt)
    m, n = np.meshgrid(np.arange(M), np.arange(N), indexing="ij")
    buf[(n // c2) * M * c2 + m * c2 + n % c2] = c          # §6 C address
    assert buf.size == (Np // c2) * M * c2
    got = unpack_c(buf.view(np.uint8), prog)
    assert got.dtype == npdt
    np.testing.assert_array_equal(got, c)


def test_unpack_c_sums_k_split_partials():
    prog = compile_matmul(3, 20000, 20, dtype="int8", out="int32")
    k = prog.k_splits
    assert k >= 2
    region = prog.c_bytes // k // 4
    buf = np.zeros(prog.c_bytes // 4, np.int32)
    for i in range(k):
        buf[i * region: (i + 1) * region] = 5 + 2 * i          # partial i of every output
    expected = sum(5 + 2 * i for i in range(k))
    np.testing.assert_array_equal(unpack_c(buf.view(np.uint8), prog), np.full((3, 20), expected, np.int32))


def test_fp16_out_with_k_split_writes_fp32_partials():
    prog = compile_matmul(2, 12000, 16, dtype="fp16", out="fp16")
    assert prog.k_splits >= 2 and prog.c_dtype == "fp32"
    buf = np.full(prog.c_bytes // 4, 0.25, np.float32)
    got = unpack_c(buf.view(np.uint8), prog)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, np.full((2, 16), 0.25 * prog.k_splits, np.float16))


def test_bad_inputs_raise_clear_errors():
    shape = MatmulShape(4, 64, 32, "fp16", "fp32")
    with pytest.raises(ValueError, match="at most"):
        pack_a(np.zeros((3, 63)), "fp16", shape)
    with pytest.raises(ValueError, match="int8 range"):
        pack_a(np.full((2, 2), 300), "int8")
    with pytest.raises(ValueError, match="quantize"):
        pack_b(np.zeros((2, 2), np.float32), "int8")
    with pytest.raises(ValueError, match="does not match"):
        pack_b(np.zeros((32, 64), np.int8), "int8", shape)
    with pytest.raises(ValueError, match="2-D"):
        pack_a(np.zeros(5), "fp16")
    prog = compile_matmul(4, 64, 32)
    with pytest.raises(ValueError, match="C buffer holds"):
        unpack_c(np.zeros(10, np.uint8), prog)


def test_pack_a_bucketed_rows_and_in_place_output():
    rng = np.random.default_rng(3)
    prog = compile_matmul(10, 70, 16)
    a = rng.standard_normal((7, 70)).astype(np.float16)
    full = np.zeros((10, 70), np.float16)
    full[:7] = a
    dest = np.full(prog.a_bytes + 32, 0xAB, np.uint8)       # dirty buffer: padding must be rewritten
    got = pack_a(a, "fp16", prog, out=dest)
    assert np.shares_memory(got, dest)
    np.testing.assert_array_equal(dest[: prog.a_bytes], pack_a(full, "fp16", prog))
    assert (dest[prog.a_bytes:] == 0xAB).all()
    with pytest.raises(ValueError, match="at most"):
        pack_a(np.zeros((11, 70)), "fp16", prog)
    with pytest.raises(ValueError, match="out must be"):
        pack_a(a, "fp16", prog, out=np.zeros(8, np.uint8))


def test_unpack_c_first_rows_only():
    prog = compile_matmul(6, 32, 20, dtype="int8", out="int32")
    buf = np.arange(prog.c_bytes // 4, dtype=np.int32)
    np.testing.assert_array_equal(unpack_c(buf.view(np.uint8), prog, rows=4), unpack_c(buf.view(np.uint8), prog)[:4])
    with pytest.raises(ValueError, match="rows"):
        unpack_c(buf.view(np.uint8), prog, rows=7)


def test_compile_refuses_buffers_beyond_32_bits():
    with pytest.raises(ValueError, match="32-bit"):
        compile_matmul(8000, 32, 151936, dtype="fp16", out="fp32", cores=3)


def test_pack_b_in_place_output():
    rng = np.random.default_rng(4)
    b = rng.integers(-100, 100, size=(50, 11000)).astype(np.int8)
    ref = pack_b(b, "int8")
    dest = np.full(ref.size + 8, 0x5A, np.uint8)
    got = pack_b(b, "int8", out=dest)
    assert np.shares_memory(got, dest)
    np.testing.assert_array_equal(dest[: ref.size], ref)
    assert (dest[ref.size:] == 0x5A).all()
    with pytest.raises(ValueError, match="out must be"):
        pack_b(b, "int8", out=np.zeros(ref.size - 1, np.uint8))
