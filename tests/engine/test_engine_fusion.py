"""Fused NPU jobs and the lean decode host path (engine/fusion.py, engine/hostpath.py,
compiler/chain.py), on the simulator through the real submit path.

Exactness: a fusion running the same program as ``NpuEngine.matmul`` gives bit-identical results
(same A bytes, same C bytes, same arithmetic on the host). Fused vs unfused: int8 is exact
(integer sums); fp16 can differ in the last fp32 bit, because the simulator's float sum over
K is a BLAS call whose rounding depends on the task's shape (a fused weight splits N over the
cores differently), so there the bound is fp32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.compiler.chain import chain_image
from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.cost.model import driver_time, modeled_time, workload_from_program
from ggml_rknpu.engine import FusedWeight, open_engine
from ggml_rknpu.engine.fusion import concat_rows, fusion_workload
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.regcmd import decode_word
from ggml_rknpu.hw.registers import REGISTERS

pytestmark = pytest.mark.timeout(300)

# (K, sibling Ns, rows): K padded to 32; 3 cores with uneven groups; K split into chunks
CASES = [(100, (48, 16, 16), 1), (256, (64, 32, 32), 3), (9000, (40, 24), 2)]


@pytest.fixture(scope="module", params=("sim-rknpu", "sim-rocket"))
def npu(request):
    engine = open_engine(request.param, cores=3, envelope="extended")   # 3 cores, long chains
    yield engine
    engine.close()


def _parts(rng, K, Ns):
    return [rng.standard_normal((n, K)).astype(np.float32) * 0.1 for n in Ns]


@pytest.mark.parametrize("dtype", ("fp16", "int8"))
@pytest.mark.parametrize("K,Ns,rows", CASES)
def test_fused_chained_and_single_fusions_match_matmul(npu, dtype, K, Ns, rows):
    rng = np.random.default_rng(K + rows)
    parts = _parts(rng, K, Ns)
    singles = [npu.upload_weight(p, dtype=dtype) for p in parts]
    fused = npu.upload_fused_weight(parts, dtype=dtype)
    a = rng.standard_normal((rows, K)).astype(np.float32)
    want = [npu.matmul(a, w) for w in singles]
    whole = npu.matmul(a, fused)

    assert isinstance(fused, FusedWeight) and fused.shape == (sum(Ns), K)
    got_single = npu.fuse([singles[0]], m=rows).run(a)
    np.testing.assert_array_equal(got_single[0], want[0])
    got_chain = npu.fuse(singles, m=rows).run(a)
    got_fused = npu.fuse([fused], m=rows).run(a)
    assert [g.shape for g in got_fused] == [(rows, n) for n in Ns]
    for (n0, n1), g in zip(fused.splits, got_fused):
        np.testing.assert_array_equal(g, whole[:, n0:n1])     # same program: bit-identical
    for w, c, f in zip(want, got_chain, got_fused):
        np.testing.assert_array_equal(c, w)                  # chained: the siblings' own programs
        if dtype == "int8":
            np.testing.assert_array_equal(f, w)
        else:
            np.testing.assert_allclose(f, w, rtol=2e-6, atol=2e-6 * np.abs(w).max())
    for w in (*singles, fused):
        w.free()


def test_chained_fusion_is_one_submit_and_counted(npu):
    rng = np.random.default_rng(1)
    parts = _parts(rng, 128, (32, 32, 64))
    ws = [npu.upload_weight(p) for p in parts]
    fusion = npu.fuse(ws, m=1)
    a = rng.standard_normal((1, 128)).astype(np.float32)
    before = dict(npu.counters)
    fusion.run(a)
    c = npu.counters
    assert c["submits"] - before["submits"] == 1
    assert c["chained_submits"] - before["chained_submits"] == 1
    assert c["matmuls"] - before["matmuls"] == 3
    assert c["programs_compiled"] == before["programs_compiled"]   # planned once
    total_tasks = sum(len(p.tasks) for p in fusion._chain.programs)
    assert sum(len(t) for t in fusion._chain.job.cores) == total_tasks
    for w in ws:
        w.free()


def test_fusion_run_reports_its_modeled_device_time_like_a_matmul(npu):
    """A fusion sets the engine's ``last_timing`` as ``NpuEngine.matmul`` does (the server counts it
    into npu_device_seconds): the cost model's figure for exactly the programs it submitted."""
    rng = np.random.default_rng(4)
    parts = _parts(rng, 256, (64, 32, 32))
    ws = [npu.upload_weight(p) for p in parts]
    a = rng.standard_normal((2, 256)).astype(np.float32)
    chained = npu.fuse(ws, m=2)
    chained.run(a)
    t = npu.last_timing
    want = driver_time(fusion_workload(chained._chain.programs), abi=npu.device.kind, npu_mhz=npu.npu_mhz).total_s
    assert t.device_label == "modeled" and t.submits == 1
    assert t.device_s == pytest.approx(want, rel=1e-12) and t.device_s > 0
    assert (t.pack_s, t.submit_s, t.unpack_s) == chained.timing
    single = npu.fuse([ws[0]], m=2)
    single.run(a)
    npu.matmul(a, ws[0])                     # the same program through the matmul path
    assert single.modeled is not None
    alone = npu.last_timing.device_s
    single.run(a)
    assert npu.last_timing.device_s == alone == single.modeled.total_s
    assert alone < t.device_s                # the chained fusion streams three weights
    for w in ws:
        w.free()


def test_chain_image_links_each_core_through_every_member():
    progs = [compile_matmul(1, 256, n, cores=3) for n in (48, 160)]
    base = 0x10000
    offsets = [0, align_up(progs[0].words.size, 8)]
    bound = [p.bind(a=0x1000, b=0x2000, c=0x3000, regcmd=base + off * 8) for p, off in zip(progs, offsets)]
    image, per_core = chain_image(progs, bound, base)
    pc_base = REGISTERS["PC_BASE_ADDRESS"].offset
    for tasks in per_core:
        for cur, nxt in zip(tasks, tasks[1:]):
            _t, value, offset = decode_word(int(image[cur.word_offset + cur.body_words]))
            assert offset == pc_base
            assert REGISTERS["PC_BASE_ADDRESS"].decode(value)["PC_SOURCE_ADDR"] * 16 == base + nxt.word_offset * 8
        last = tasks[-1]
        assert int(image[last.word_offset + last.body_words]) == 0     # the chain ends: NOP tail
    assert sum(map(len, per_core)) == sum(len(p.tasks) for p in progs)
    # a one-member chain is the program's own bound image
    solo, _ = chain_image(progs[:1], bound[:1], base)
    np.testing.assert_array_equal(solo, bound[0])


def test_fusion_workload_prices_all_members_in_one_submit():
    progs = [compile_matmul(1, 1536, n, dtype="int8", out="int32", cores=3) for n in (1536, 256, 256)]
    work = fusion_workload(progs)
    assert work.submits == 1
    assert len(work.tasks) == sum(len(workload_from_program(p).tasks) for p in progs)
    separate = sum(modeled_time(p).total_s for p in progs)
    assert modeled_time(work).total_s < separate       # two submits fewer


def test_freeing_a_member_closes_its_chained_fusion_and_frees_its_buffers(npu):
    rng = np.random.default_rng(3)
    ws = [npu.upload_weight(p) for p in _parts(rng, 64, (16, 16))]
    fusion = npu.fuse(ws, m=1)
    buffers = list(fusion._chain.buffers)
    assert len(buffers) == 2 and not any(b.closed for b in buffers)      # A and C in one, regcmd
    ws[1].free()
    assert fusion.closed and all(b.closed for b in buffers)
    with pytest.raises(ValueError, match="closed"):
        fusion.run(np.ones((1, 64), np.float32))
    assert fusion not in ws[0].fusions
    ws[0].free()


def test_fusion_results_reuse_their_arrays_and_accept_outs(npu):
    rng = np.random.default_rng(4)
    fused = npu.upload_fused_weight(_parts(rng, 96, (32, 16)), dtype="int8")
    fusion = npu.fuse([fused], m=1)
    a = rng.standard_normal((1, 96)).astype(np.float32)
    first = fusion.run(a)
    second = fusion.run(a * 2)
    assert all(np.shares_memory(x, y) for x, y in zip(first, second))   # no per-call result arrays
    outs = [np.empty((1, 32), np.float32), np.empty((1, 16), np.float32)]
    got = fusion.run(a * 2, outs)
    assert got[0].base is outs[0] or got[0] is outs[0] or np.shares_memory(got[0], outs[0])
    np.testing.assert_array_equal(outs[1], second[1])
    fused.free()


def test_fusion_refuses_bad_input_clearly(npu):
    rng = np.random.default_rng(5)
    w = npu.upload_weight(_parts(rng, 64, (16,))[0])
    fusion = npu.fuse([w], m=2)
    with pytest.raises(ValueError, match="shape"):
        fusion.run(np.ones((1, 65), np.float32))
    with pytest.raises(ValueError, match="shape"):
        fusion.run(np.ones((3, 64), np.float32))        # more rows than the fusion was planned for
    bad = np.ones((1, 64), np.float32)
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fusion.run(bad)
    with pytest.raises(ValueError, match="fp16 range"):
        fusion.run(np.full((1, 64), 1e6, np.float32))
    with pytest.raises(TypeError, match="int8"):
        fusion.run(np.ones((1, 64), np.int8))
    w8 = npu.upload_weight(_parts(rng, 64, (16,))[0].astype(np.float32), dtype="int8")
    with pytest.raises(ValueError, match="share K and dtype"):
        npu.fuse([w, w8], m=1)
    with pytest.raises(ValueError, match="share K"):
        concat_rows([np.ones((2, 3)), np.ones((2, 4))])
    w.free()
    w8.free()


def test_int8_activations_are_exact_through_a_fusion(npu):
    rng = np.random.default_rng(6)
    b = rng.integers(-128, 128, (48, 160), dtype=np.int8)
    w = npu.upload_weight(b, dtype="int8")
    a = rng.integers(-128, 128, (3, 160), dtype=np.int8)
    got = npu.fuse([w], m=3).run(a)[0]
    np.testing.assert_array_equal(got, a.astype(np.int32) @ b.astype(np.int32).T)
    w.free()


def test_rehearse_is_the_host_side_of_run_without_a_submit(npu):
    rng = np.random.default_rng(7)
    fused = npu.upload_fused_weight(_parts(rng, 128, (64, 32)), dtype="int8")
    fusion = npu.fuse([fused], m=1)
    a = rng.standard_normal((1, 128)).astype(np.float32)
    want = [x.copy() for x in fusion.run(a)]
    submits = npu.counters["submits"]
    got = [np.full_like(w, np.nan) for w in want]
    seconds = fusion.rehearse(a, got)   # C still holds the last run's output: same values back
    assert seconds > 0 and npu.counters["submits"] == submits
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    fused.free()


@pytest.mark.parametrize("K", (100, 9000))
def test_fp16_output_fusion_matches_matmul(npu, K):
    rng = np.random.default_rng(K)
    w = npu.upload_weight(_parts(rng, K, (40,))[0])
    a = rng.standard_normal((2, K)).astype(np.float32)
    got = npu.fuse([w], m=2, out="fp16").run(a)[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, npu.matmul(a, w, out="fp16"))
    w.free()


@pytest.mark.parametrize("a_int8", (False, True))
@pytest.mark.parametrize("K,N,rows", [(160, 64, 5), (9000, 96, 16), (200, 40, 3)])
def test_multirow_int8_reads_match_matmul(npu, a_int8, K, N, rows):
    """Many rows: the atom-wise transpose out of C (N whole atoms) and the general one
    (N = 40: not), float-quantised weight scales with and without activation scales."""
    rng = np.random.default_rng(K + N)
    w = npu.upload_weight(rng.standard_normal((N, K)).astype(np.float32), dtype="int8")
    a = (rng.integers(-128, 128, (rows, K), dtype=np.int8) if a_int8
         else rng.standard_normal((rows, K)).astype(np.float32))
    np.testing.assert_array_equal(npu.fuse([w], m=rows).run(a)[0], npu.matmul(a, w))
    w.free()


@pytest.mark.parametrize("K,N,rows", [(100, 48, 1), (256, 160, 3), (9000, 40, 2), (64, 1000, 16)])
def test_lean_matmul_equals_the_general_path(npu, K, N, rows):
    """``NpuEngine.matmul`` takes the lean path for float activations; int8 activations against an
    fp16 weight still take the general one (stage_activation, pack_a, unpack_c). The same
    values both ways give the same bits."""
    rng = np.random.default_rng(K * N)
    w = npu.upload_weight(_parts(rng, K, (N,))[0])
    a8 = rng.integers(-128, 128, (rows, K), dtype=np.int8)
    general = npu.matmul(a8, w)
    lean = npu.matmul(a8.astype(np.float32), w)
    np.testing.assert_array_equal(lean, general)
    np.testing.assert_array_equal(npu.matmul(a8.astype(np.float32), w, out="fp16"),
                                  npu.matmul(a8, w, out="fp16"))
    w.free()


@pytest.mark.parametrize("K,N,rows", [(100, 48, 1), (9000, 40, 2), (64, 1000, 16)])
def test_lean_int8_matmul_equals_the_quantised_reference(npu, K, N, rows):
    from ggml_rknpu.engine.staging import quantize_rows_int8

    rng = np.random.default_rng(K + N)
    b = rng.standard_normal((N, K)).astype(np.float32)
    a = rng.standard_normal((rows, K)).astype(np.float32)
    w = npu.upload_weight(b, dtype="int8")
    qa, sa = quantize_rows_int8(a, "a")
    qb, sb = quantize_rows_int8(b, "b")
    want = (qa.astype(np.int32) @ qb.astype(np.int32).T).astype(np.float32)
    want *= sa[:, None]
    want *= sb[None, :]
    np.testing.assert_array_equal(npu.matmul(a, w), want)
    np.testing.assert_array_equal(npu.matmul(qa, w), (qa.astype(np.int32) @ qb.astype(np.int32).T)
                                  .astype(np.float32) * sb[None, :])
    w.free()


@pytest.mark.parametrize("peak", (1e-45, 3e-43, 1e-40, 1e-30))
def test_tiny_activations_quantise_like_the_general_path(npu, peak):
    """Rows whose scale underflows (peak / 127 = 0) or is subnormal: same q and scales as
    quantize_rows_int8, so the same result."""
    from ggml_rknpu.compiler.shape import MatmulShape
    from ggml_rknpu.engine.hostpath import ActivationPort
    from ggml_rknpu.engine.staging import quantize_rows_int8

    rng = np.random.default_rng(8)
    for rows in (1, 3):
        x = (rng.uniform(-1, 1, (rows, 64)) * peak).astype(np.float32)
        x[0, 0] = np.float32(peak)
        port = ActivationPort(MatmulShape(rows, 64, 32, "int8", "int32"), quantize=True)
        raw = np.zeros(64 * rows, np.uint8)
        port.bind(raw)
        scales = port.write(x)
        q, want_scales = quantize_rows_int8(x, "x")
        np.testing.assert_array_equal(scales, want_scales)
        got = raw.view(np.int8).reshape(4, rows, 16).transpose(1, 0, 2).reshape(rows, 64)
        np.testing.assert_array_equal(got, q)


def test_proven_envelope_refuses_an_int8_chain_but_runs_the_fused_weight():
    """The proven envelope has one-task int8 PC chains: chaining int8 siblings would leave
    it, so the fusion is refused with the way out; the fused weight (one program, chains as
    the envelope cuts them) runs."""
    rng = np.random.default_rng(9)
    engine = open_engine("sim-rknpu", envelope="proven")
    try:
        parts = _parts(rng, 128, (64, 32, 32))
        ws = [engine.upload_weight(p, dtype="int8") for p in parts]
        with pytest.raises(ValueError, match="fused weight"):
            engine.fuse(ws, m=1)
        fused = engine.upload_fused_weight(parts, dtype="int8")
        a = rng.standard_normal((1, 128)).astype(np.float32)
        got = engine.fuse([fused], m=1).run(a)
        for w, g in zip(ws, got):
            np.testing.assert_array_equal(g, engine.matmul(a, w))
    finally:
        engine.close()
