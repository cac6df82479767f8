"""Program: PC-chained tails, relocation binding, alignment, and numerics of whole
programs checked by interpreting the *emitted register values* with numpy in the §6
layouts (a test-side check only; the independent executor is the simulator's job)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler.layout import pack_a, pack_b, unpack_c
from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.compiler.tiling import k_chunks
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.regcmd import Target, decode_word, fetch_amount, task_tail, words_for_amount
from ggml_rknpu.hw.registers import BY_OFFSET

PREC_BYTES = {0: 1, 2: 2, 4: 4, 5: 4}                 # DPU/CNA precision code -> bytes [§1]
PREC_NP = {0: np.int8, 2: np.float16, 4: np.int32, 5: np.float32}


def task_regs(words, task):
    regs = {}
    for w in words[task.word_offset: task.word_offset + task.body_words]:
        _t, value, offset = decode_word(int(w))
        reg = BY_OFFSET[offset]
        regs[reg.name] = reg.decode(value)
    return regs


def run_on_arena(arena: np.ndarray, words: np.ndarray, program) -> None:
    """Execute every task as the 1x1 convolution its registers describe (W = 1)."""
    for task in program.tasks:
        r = task_regs(words, task)
        in_code = r["CNA_CONV_CON1"]["IN_PRECISION"]
        b = PREC_BYTES[in_code]
        c2 = 16 // b
        H = r["CNA_DATA_SIZE0"]["DATAIN_HEIGHT"]
        assert r["CNA_DATA_SIZE0"]["DATAIN_WIDTH"] == 1
        C = r["CNA_DATA_SIZE1"]["DATAIN_CHANNEL"]
        ss = r["CNA_DMA_CON2"]["SURF_STRIDE"]
        ss = ss - (1 << 28) if ss >> 27 else ss
        pitch = 16 * (r["CNA_DMA_CON1"]["LINE_STRIDE"] + ss)            # §7 field notes
        fa = r["CNA_FEATURE_DATA_ADDR"]["FEATURE_BASE_ADDR"]
        h, c = np.meshgrid(np.arange(H), np.arange(C), indexing="ij")
        a_idx = fa + (c // c2) * pitch + h * 16 + (c % c2) * b
        a = arena.view(PREC_NP[in_code])[a_idx // b]
        kernels = r["CNA_WEIGHT_SIZE2"]["WEIGHT_KERNELS"]
        kc = r["CNA_WEIGHT_SIZE1"]["WEIGHT_BYTES_PER_KERNEL"] // b
        assert kc == C
        g = 16 if b == 2 else 32
        wa = r["CNA_DCOMP_ADDR0"]["DECOMPRESS_ADDR0"]
        wbytes = r["CNA_WEIGHT_SIZE0"]["WEIGHT_BYTES"]
        blocked = arena[wa: wa + wbytes].view(PREC_NP[in_code]).reshape(kernels // g, kc // 32, g, 32)
        wt = blocked.transpose(0, 2, 1, 3).reshape(kernels, kc)
        acc = a.astype(np.float64) @ wt.astype(np.float64).T if b == 2 else a.astype(np.int64) @ wt.astype(np.int64).T
        fmt = r["DPU_DATA_FORMAT"]
        oc = fmt["OUT_PRECISION"]
        ob = PREC_BYTES[oc]
        oc2 = 16 // ob
        n_out = r["DPU_DATA_CUBE_CHANNEL"]["CHANNEL"] + 1
        assert n_out == kernels and r["DPU_DATA_CUBE_HEIGHT"]["HEIGHT"] + 1 == H
        da = r["DPU_DST_BASE_ADDR"]["DST_BASE_ADDR"]
        dpitch = 16 * r["DPU_DST_SURF_STRIDE"]["DST_SURF_STRIDE"]
        h, n = np.meshgrid(np.arange(H), np.arange(n_out), indexing="ij")
        c_idx = da + (n // oc2) * dpitch + h * 16 + (n % oc2) * ob
        arena.view(PREC_NP[oc])[c_idx // ob] = acc.astype(PREC_NP[oc])


def run_program(a, b_nk, prog):
    a_np, b_np = pack_a(a, prog.shape.dtype, prog), pack_b(b_nk, prog.shape.dtype, prog)
    assert a_np.size == prog.a_bytes and b_np.size == prog.b_bytes
    A = 0x1000
    B = A + align_up(prog.a_bytes, 4096)
    C = B + align_up(prog.b_bytes, 4096)
    R = C + align_up(prog.c_bytes, 4096)
    arena = np.zeros(R + prog.regcmd_bytes, np.uint8)
    arena[A: A + a_np.size] = a_np
    arena[B: B + b_np.size] = b_np
    words = prog.bind(a=A, b=B, c=C, regcmd=R)
    arena[R:].view(np.uint64)[:] = words
    run_on_arena(arena, words, prog)
    return unpack_c(arena[C: C + prog.c_bytes], prog)


MODES = [("fp16", "fp32"), ("fp16", "fp16"), ("int8", "int32")]


def reference(a, b_nk, mode):
    if mode[0] == "int8":
        return a.astype(np.int64) @ b_nk.astype(np.int64).T
    return a.astype(np.float64) @ b_nk.astype(np.float64).T


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 1200), st.integers(1, 700), st.integers(1, 300), st.sampled_from(MODES),
       st.integers(1, 3), st.integers(0, 2**31))
def test_programs_compute_the_matmul(M, K, N, mode, cores, seed):
    rng = np.random.default_rng(seed)
    # integer-valued data: fp16 products and fp32 sums are exact here [§10]
    a = rng.integers(-3, 4, size=(M, K)).astype(np.int8 if mode[0] == "int8" else np.float16)
    b = rng.integers(-3, 4, size=(N, K)).astype(np.int8 if mode[0] == "int8" else np.float16)
    prog = compile_matmul(M, K, N, dtype=mode[0], out=mode[1], cores=cores, envelope="extended")
    got = run_program(a, b, prog)
    assert got.shape == (M, N)
    np.testing.assert_array_equal(got.astype(np.float64), reference(a, b, mode))


@pytest.mark.parametrize("mode", MODES)
def test_k_split_programs_compute_the_matmul(mode):
    rng = np.random.default_rng(7)
    M, K, N = 5, 21000, 40                      # 3 K chunks, unaligned K and N, 3 cores
    a = rng.integers(-2, 3, size=(M, K)).astype(np.int8 if mode[0] == "int8" else np.float16)
    b = rng.integers(-2, 3, size=(N, K)).astype(np.int8 if mode[0] == "int8" else np.float16)
    prog = compile_matmul(M, K, N, dtype=mode[0], out=mode[1], cores=3, envelope="extended")
    assert prog.k_splits == len(k_chunks(K, mode[0], "extended")) >= 3
    np.testing.assert_array_equal(run_program(a, b, prog).astype(np.float64), reference(a, b, mode))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 12000), st.integers(1, 20000), st.sampled_from(MODES), st.integers(1, 3))
def test_tails_chain_each_core_and_bind_patches_exactly_the_relocs(M, K, N, mode, cores):
    try:
        prog = compile_matmul(M, K, N, dtype=mode[0], out=mode[1], cores=cores, envelope="extended")
    except ValueError as e:
        assert "4095" in str(e)
        return
    R = 0x0010_0000
    bound = prog.bind(a=0x1000, b=0x2000_0000, c=0x4000_0000, regcmd=R)
    zero = prog.bind(a=0, b=0, c=0, regcmd=0)
    np.testing.assert_array_equal(zero, prog.words)             # unbound words hold offsets
    changed = set(np.flatnonzero(bound != prog.words).tolist())
    reloc_idx = {r.word_index for r in prog.relocs}
    assert changed == reloc_idx and len(reloc_idx) == len(prog.relocs)
    for r in prog.relocs:
        base = {"A": 0x1000, "B": 0x2000_0000, "C": 0x4000_0000, "REGCMD": R}[r.role]
        assert decode_word(int(bound[r.word_index]))[1] == base + r.offset
    for core in range(prog.cores_used):
        tasks = prog.core_tasks(core)
        assert tasks
        for cur, nxt in zip(tasks, tasks[1:] + (None,)):
            assert (cur.word_offset * 8) % 64 == 0                          # 64-byte aligned tasks
            tail = [int(w) for w in bound[cur.word_offset + cur.body_words: cur.word_offset + cur.body_words + 4]]
            if nxt is None:
                assert tail == task_tail(0, 0, cur.enable_mask)
                continue
            assert tail == task_tail(R + nxt.word_offset * 8, nxt.body_words, cur.enable_mask)
            assert decode_word(tail[0]) == (Target.PC, R + nxt.word_offset * 8, 0x0010)
            amount = decode_word(tail[1])[1]
            assert amount == fetch_amount(nxt.body_words)
            fetched = words_for_amount(amount)
            assert nxt.body_words + 4 <= fetched <= nxt.body_words + 5
            # a fetch that overruns by one word reads a NOP, never the next task
            assert all(int(w) == 0 for w in bound[nxt.word_offset + nxt.body_words + 4: nxt.word_offset + fetched])
    assert sum(len(prog.core_tasks(c)) for c in range(prog.cores_used)) == len(prog.tasks)


def test_bind_rejects_bad_addresses():
    prog = compile_matmul(4, 64, 32)
    with pytest.raises(ValueError, match="aligned"):
        prog.bind(a=0x1008, b=0, c=0, regcmd=0)
    with pytest.raises(ValueError, match="32-bit"):
        prog.bind(a=0, b=0xFFFF_FF00, c=0, regcmd=0)
    with pytest.raises(ValueError, match="aligned"):
        prog.bind(a=0, b=0, c=0, regcmd=-16)


def test_rocket_and_vendor_streams_are_identical():
    v = compile_matmul(100, 300, 500, cores=3, abi="rknpu")
    r = compile_matmul(100, 300, 500, cores=3, abi="rocket")
    np.testing.assert_array_equal(v.words, r.words)
    assert v.tasks == r.tasks and r.abi == "rocket"
    with pytest.raises(ValueError, match="abi"):
        compile_matmul(4, 64, 32, abi="cuda")


def test_compile_is_cached_and_words_read_only():
    assert compile_matmul(64, 128, 256) is compile_matmul(64, 128, 256)
    with pytest.raises(ValueError):
        compile_matmul(64, 128, 256).words[0] = 1
