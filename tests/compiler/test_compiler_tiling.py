"""Tiling invariants over random shapes: CBUF fit, field ranges, exact coverage of
(m, n, k), task limits per core [npu-programming.md §9]."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.compiler.tiling import MAX_TASK_K, MIN_CHUNK_K, _tile, k_chunks, modeled_seconds, tile
from ggml_rknpu.engine.envelope_record import RUNGS, envelope_for_rungs
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.hw.envelope import PROVEN
from ggml_rknpu.hw.regcmd import decode_word
from ggml_rknpu.hw.registers import BY_OFFSET

MODES = [("fp16", "fp32"), ("fp16", "fp16"), ("int8", "int32")]
shapes = st.tuples(
    st.integers(1, 3000), st.integers(1, 40000), st.integers(1, 20000),
    st.sampled_from(MODES), st.integers(1, 3),
)


def check_tiling(M, K, N, mode, cores, envelope="extended"):
    shape = MatmulShape(M, K, N, *mode)
    t = tile(shape, cores, envelope)
    b, g = shape.in_bytes, shape.kernel_group
    # K chunks partition [0, Kp) in whole atoms, each within the per-task K limit
    k0 = 0
    for ch in t.chunks:
        assert ch.k0 == k0 and ch.size % 32 == 0 and 0 < ch.size <= MAX_TASK_K
        assert ch.size * b <= limits.CBUF_BANK_BYTES          # one kernel fits one bank [§9]
        k0 += ch.size
    assert k0 == shape.Kp
    # the partial C regions (K ranges the tasks compute) partition [0, Kp) too
    partials = t.partials or t.chunks
    assert [p.index for p in partials] == list(range(t.k_splits))
    assert sum(p.size for p in partials) == shape.Kp and [p.k0 for p in partials] == sorted(p.k0 for p in partials)
    per_core: dict[int, int] = {}
    cover = {ch.index: np.zeros((shape.M, shape.Np // g), np.int32) for ch in partials}
    for task in t.tasks:
        per_core[task.core] = per_core.get(task.core, 0) + 1
        kc = task.chunk.size
        assert 1 <= task.m <= 1022 and task.n % g == 0 and 0 < task.n <= 8192
        assert task.n0 % g == 0
        if task.block is not None:       # part of a weight chunk: one kernel group, inside its chunk
            assert task.n == g and task.block in t.chunks
            assert task.block.k0 <= task.chunk.k0 and task.chunk.k0 + kc <= task.block.k0 + task.block.size
        # input fits the data banks, DATA_BANK + WEIGHT_BANK = 12 [§7, §9]
        assert task.m * kc * b <= task.data_banks * limits.CBUF_BANK_BYTES
        assert 1 <= task.data_banks <= 11 and task.data_banks + task.weight_banks == 12
        # a whole kernel group fits the weight banks (our conservative rule, tiling.py)
        assert g * kc * b <= task.weight_banks * limits.CBUF_BANK_BYTES
        cover[task.chunk.index][task.m0: task.m0 + task.m, task.n0 // g: (task.n0 + task.n) // g] += 1
    for c in cover.values():
        assert (c == 1).all()                                  # every (m, n, k) exactly once
    assert all(n <= limits.MAX_TASKS_PER_SUBMIT for n in per_core.values())
    assert sorted(per_core) == list(range(t.cores_used)) and t.cores_used <= cores
    # tasks of a core are contiguous (one PC chain per core)
    order = [task.core for task in t.tasks]
    assert order == sorted(order)
    return t


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_tiling_invariants(args):
    M, K, N, mode, cores = args
    try:
        check_tiling(M, K, N, mode, cores)
    except ValueError as e:                  # only the documented task-count limit may refuse
        assert "4095" in str(e)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 1022), st.integers(8193, 40000), st.integers(1, 12000),
       st.sampled_from(MODES), st.integers(1, 3))
def test_tiling_invariants_long_k(M, K, N, mode, cores):
    # K > 8192 is chunked for rows per task (tiling.py); every bank and coverage rule holds
    try:
        t = check_tiling(M, K, N, mode, cores)
    except ValueError as e:
        assert "4095" in str(e)
        return
    assert t.k_splits >= 2


@settings(max_examples=15, deadline=None)
@given(st.tuples(st.integers(1, 1500), st.integers(1, 25000), st.integers(1, 9000),
                 st.sampled_from(MODES), st.integers(1, 3)))
def test_every_field_in_range_and_every_word_known(args):
    M, K, N, mode, cores = args
    prog = compile_matmul(M, K, N, dtype=mode[0], out=mode[1], cores=cores, envelope="extended")
    words = prog.bind(a=0x1000, b=0x0100_0000, c=0x4000_0000, regcmd=0x8000_0000)
    for task in prog.tasks:
        for w in words[task.word_offset: task.word_offset + task.body_words]:
            target, value, offset = decode_word(int(w))
            reg = BY_OFFSET[offset]
            assert reg.encode(**reg.decode(value)) == value     # no bits outside known fields


def test_large_shapes_from_the_issue_sweep():
    for M, K, N, mode in [(4096, 11008, 4096, ("fp16", "fp32")), (1, 4096, 151936, ("int8", "int32")),
                          (513, 8192, 32000, ("fp16", "fp16")), (196, 100, 1001, ("int8", "int32"))]:
        t = check_tiling(M, K, N, mode, 3)
        assert t.cores_used == 3


def test_golden_shapes_stay_single_task():
    for M, K, N, dt in [(384, 384, 4096, "fp16"), (544, 544, 4096, "int8"), (1, 8192, 8192, "fp16")]:
        assert len(tile(MatmulShape(M, K, N, dt, "int32" if dt == "int8" else "fp32"), 1, "extended").tasks) == 1


def test_k_split_only_beyond_the_sdk_split_point():
    # one chunk up to Kp = 8192 (SDK split point [rknn-toolkit.md §4.4]; MTX golden 1x8192x8192)
    assert len(k_chunks(8192, "fp16", "extended")) == 1
    assert len(k_chunks(8161, "int8", "extended")) == 1
    # beyond it: chunks of 1024..10240 channels, chosen by the modeled reference prefill
    for K, dtype in [(8193, "fp16"), (8960, "fp16"), (10240, "fp16"), (11008, "int8"), (40000, "int8")]:
        chunks = k_chunks(K, dtype, "extended")
        assert len(chunks) >= 2
        Kp = align_up(K, 32)
        assert len(chunks) <= ceil_div(Kp, MIN_CHUNK_K) and all(c.size <= MAX_TASK_K for c in chunks)
        assert chunks[-1].size <= chunks[0].size


def test_core_split_prefers_n_then_m():
    t = tile(MatmulShape(1, 64, 48, "fp16", "fp32"), 3, "extended")            # 3 kernel groups -> N split
    assert {(x.core, x.n0, x.n) for x in t.tasks} == {(0, 0, 16), (1, 16, 16), (2, 32, 16)}
    t = tile(MatmulShape(30, 64, 16, "fp16", "fp32"), 3, "extended")           # 1 group -> M split
    assert {(x.core, x.m0, x.m) for x in t.tasks} == {(0, 0, 10), (1, 10, 10), (2, 20, 10)}
    t = tile(MatmulShape(1, 64, 16, "fp16", "fp32"), 3, "extended")            # nothing to split
    assert t.cores_used == 1


def test_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="cores"):
        tile(MatmulShape(4, 64, 32, "fp16", "fp32"), 4)
    with pytest.raises(ValueError, match="unsupported matmul precision"):
        MatmulShape(4, 64, 32, "int8", "fp32")
    with pytest.raises(ValueError, match="positive"):
        MatmulShape(0, 64, 32, "fp16", "fp32")
    with pytest.raises(ValueError, match="4095"):
        tile(MatmulShape(1022 * 4096, 32, 16, "fp16", "fp32"), 1)


LADDERED = envelope_for_rungs(list(RUNGS), "rknpu")   # the forecast's envelope (bench decode)


def _plain(shape, cores, env):
    return _tile(shape, min(cores, env.max_cores), k_chunks(shape.K, shape.dtype, env), env)


@pytest.mark.parametrize("env,M,K,N,before_ms,after_ms", [
    # modeled (cost.model, 1 GHz, DRAM 2112 MHz, 79 us per submit); docs/engine.md records them
    (PROVEN, 16, 8192, 2048, 26.855, 7.271),      # Llama-3.2-1B down: 8 M tiles of 2 rows -> 2 runs of 4096
    (PROVEN, 16, 6912, 1152, 6.456, 3.585),       # Gemma3-1B down
    (PROVEN, 8, 8192, 2048, 13.467, 5.720),
    (LADDERED, 9, 8192, 2048, 2.465, 2.133),      # M = 9 compiled as such (the engine buckets it to 16)
])
def test_decode_rows_of_long_k_split_k_over_one_group_tasks(env, M, K, N, before_ms, after_ms):
    shape = MatmulShape(M, K, N, "fp16", "fp32")
    plain, t = _plain(shape, 3, env), tile(shape, 3, env)
    assert plain.k_splits == 1 and t.k_splits == 2 and t.chunks == plain.chunks     # same weight layout
    assert all(task.n == 16 and task.block == plain.chunks[0] for task in t.tasks)
    assert {task.m for task in t.tasks} == {M}                                    # no re-streaming
    assert {p.size for p in t.partials} <= {4096, 3584, 3328} and all(p.size % 256 == 0 for p in t.partials)
    assert modeled_seconds(plain, env) * 1e3 == pytest.approx(before_ms, abs=5e-4)
    assert modeled_seconds(t, env) * 1e3 == pytest.approx(after_ms, abs=5e-4)
    check_tiling(M, K, N, ("fp16", "fp32"), 3, env)


@pytest.mark.parametrize("env,M,K,N", [
    (LADDERED, 16, 8192, 2048),    # one-group tasks re-read A (16 rows = as many bytes as the group's weights)
    (LADDERED, 16, 6912, 1152),
    (PROVEN, 16, 6144, 2048),      # 2 M tiles, but the split streams A per group: modeled slower
    (PROVEN, 1, 8192, 8192),       # the golden shape: one task, one chunk
    (PROVEN, 17, 8192, 2048),      # beyond decode rows: not evaluated
])
def test_no_split_where_it_is_not_cheaper_or_not_decode(env, M, K, N):
    shape = MatmulShape(M, K, N, "fp16", "fp32")
    assert tile(shape, 3, env) == _plain(shape, 3, env)


@pytest.mark.parametrize("M,K,N", [(16, 8192, 2048), (16, 6912, 1152)])
def test_split_k_tasks_read_the_bytes_of_a_chunk_of_their_own(M, K, N):
    """A one-group task reading part of a weight chunk in place sees, byte for byte, what a
    weight packed with that K range as a chunk of its own holds: the hardware reads the same
    stream as a K-chunked program (what hardware-run streams cover), not a new layout."""
    from ggml_rknpu.compiler.emit import buffer_offsets
    from ggml_rknpu.compiler.layout import pack_b

    shape = MatmulShape(M, K, N, "fp16", "fp32")
    t = tile(shape, 3, PROVEN)
    assert t.partials and all(task.block is not None for task in t.tasks)
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    native = pack_b(w, "fp16", shape, envelope=PROVEN)
    g, b = shape.kernel_group, shape.in_bytes
    for task in t.tasks:
        k0, kc = task.chunk.k0, task.chunk.size
        start = buffer_offsets(shape, task, "fp32")["B"]
        own = pack_b(w[task.n0: task.n0 + g, k0: k0 + kc], "fp16", MatmulShape(1, kc, g, "fp16", "fp32"),
                     envelope=PROVEN)
        assert own.size == kc * g * b
        assert np.array_equal(native[start: start + own.size], own), (task.n0, k0, kc)
