"""The simulator's fast paths against its reference path.

* Bulk execution (``sim.execute.BulkConv``: a run's M tiles over one weight block as one GEMM)
  gives what executing every task on its own gives (``SimNpu.bulk = False``): the same
  integers for int8; for fp16 the same exact products summed in another fp32 order, since a
  BLAS picks its kernel (and its own thread split) per shape, so within the summation bound
  of the per-task result, on a sweep of shapes, dtypes and output types, through the public
  API on both ABIs.
* Split GEMMs (``sim.gemm.Gemm``: a one-row fp16 GEMM over large weights in blocks on several
  host threads) give the same bytes whatever the thread count (the blocks follow from the
  shape alone), and stay within the summation bound of one BLAS call.
* Decode once, execute many: a replayed program gives the same result and a refused one
  the same diagnostic; decoded operands are reused only while their bytes are unchanged
  (a synced weight change is seen, an unsynced CPU write is not, untracked memory is read
  again every run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import ggml_rknpu
from ggml_rknpu.hw.regcmd import task_tail, write_word
from ggml_rknpu.hw.registers import REGISTERS
from ggml_rknpu.sim import gemm as sim_gemm
from ggml_rknpu.sim.npu import SimNpu
from support.sim_support import REGCMD_ADDR, FakeMemory, pack_feature, pack_weights, unpack_output, vendor_submit

pytestmark = pytest.mark.timeout(300)
ABIS = ("sim-rknpu", "sim-rocket")


@dataclass(frozen=True)
class _Fp16Task:
    """All a GEMM reads of its task (``sim.gemm.GemmTask``)."""

    precision: str = "fp16"


def _model(engine) -> SimNpu:
    return engine.device.syscalls._npu_model()


@pytest.fixture(scope="module", params=ABIS)
def engine(request):
    npu = ggml_rknpu.open(device=request.param)
    yield npu
    npu.close()


def _both_paths(engine, a: np.ndarray, b: np.ndarray, dtype: str, out: str | None):
    """(bulk result, per-task result, tasks merged by the bulk run)."""
    sim = _model(engine)
    w = engine.upload_weight(b, dtype)
    try:
        sim.bulk = True
        merged0 = sim.merged_tasks
        bulk = engine.matmul(a, w, out=out)
        merged = sim.merged_tasks - merged0
        sim.bulk = False
        sim.operands.clear()          # the reference decodes its operands afresh
        reference = engine.matmul(a, w, out=out)
    finally:
        sim.bulk = True
        w.free()
    return bulk, reference, merged


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _same_up_to_summation_order(got: np.ndarray, ref: np.ndarray, a: np.ndarray, b: np.ndarray,
                                dtype: str) -> bool:
    """int8: the same integers. fp16: two fp32 sums of the same K exact products, in orders
    we do not assume, are each within gamma_K * sum_k |a_k b_k| of the exact sum, gamma_K =
    K u / (1 - K u), u = 2^-24 [Higham, Accuracy and Stability of Numerical Algorithms, Thm
    3.1/Lemma 3.1], so within twice that of each other; an fp16 output adds one fp16 step."""
    if dtype == "int8" or got.dtype != ref.dtype or got.shape != ref.shape:
        return _same_bits(got, ref)
    k = a.shape[1]
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    a16, b16 = (np.abs(x.astype(np.float16).astype(np.float64)) for x in (a, b))
    bound = 2 * gamma * (a16 @ b16.T)
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    if got.dtype == np.float16:
        bound = bound + np.spacing(np.maximum(np.abs(got), np.abs(ref))).astype(np.float64)
    return bool(np.all(diff <= bound))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 600), k32=st.integers(1, 64), n=st.integers(1, 400),
       kind=st.sampled_from(("fp16", "fp16->fp16", "int8")), seed=st.integers(0, 2**16))
def test_bulk_equals_per_task(engine, m, k32, n, kind, seed):
    rng = np.random.default_rng(seed)
    k = 32 * k32
    if kind == "int8":
        a = rng.integers(-128, 128, (m, k)).astype(np.int8)
        b = rng.integers(-128, 128, (n, k)).astype(np.float32)
        dtype, out = "int8", None
    else:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((n, k)).astype(np.float32)
        dtype, out = "fp16", ("fp16" if kind == "fp16->fp16" else None)
    bulk, reference, merged = _both_paths(engine, a, b, dtype, out)
    event(f"tasks merged: {'some' if merged else 'none'}")
    assert _same_up_to_summation_order(bulk, reference, a, b, dtype)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k32=st.integers(1, 20), out=st.sampled_from((None, "fp16")),
       n=st.one_of(st.integers(8193, 40000), st.builds(lambda j, r: 8192 * j + r,
                                                       st.integers(1, 4), st.integers(-2, 2))),
       seed=st.integers(0, 2**16))
def test_one_row_n_tiles_in_bulk_equal_per_task(engine, k32, n, out, seed):
    """Decode (M=1) over weights wider than one N tile (8192): the tiles of a run merge
    into one GEMM on the vendor ABI."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((1, 32 * k32)).astype(np.float32)
    b = rng.standard_normal((n, 32 * k32)).astype(np.float32)
    bulk, reference, merged = _both_paths(engine, a, b, "fp16", out)
    event(f"tasks merged: {'some' if merged else 'none'}")
    assert _same_up_to_summation_order(bulk, reference, a, b, "fp16")


@pytest.mark.slow
def test_output_projection_tiles_merge_into_one_gemm(engine):
    """gemma3-270m's output projection (K=640, N=262144) at one row: on the vendor ABI the
    tiles of each core's run become one GEMM, within the per-task path's summation bound (slow: 30 s and
    2.7 GB of decoded weights; the one-row sweep above covers the merge in CI)."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal((1, 640)).astype(np.float32)
    b = rng.standard_normal((262144, 640)).astype(np.float32)
    bulk, reference, merged = _both_paths(engine, a, b, "fp16", None)
    assert _same_up_to_summation_order(bulk, reference, a, b, "fp16")
    if engine.device.kind == "rknpu":
        assert merged > 0
    _model(engine).operands.clear()      # 1.3 GB of decoded weights


@pytest.mark.parametrize("dtype", ("fp16", "int8"))
def test_prefill_tiles_run_in_bulk_and_match(engine, dtype):
    """fp16 M=512 is several M tiles per core on the vendor ABI (one PC run per core): the
    bulk path merges them. Rocket runs one task per PC run, and the int8 programs of the
    proven envelope (hw/envelope.py) one task per submit, so nothing merges there."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((512, 2048)).astype(np.float32)
    if dtype == "int8":
        a = rng.integers(-128, 128, a.shape).astype(np.int8)
    b = rng.standard_normal((96, 2048)).astype(np.float32)
    bulk, reference, merged = _both_paths(engine, a, b, dtype, None)
    assert _same_up_to_summation_order(bulk, reference, a, b, dtype)
    if engine.device.kind == "rknpu" and dtype == "fp16":
        assert merged > 0
    else:
        assert merged == 0


def test_replayed_weights_follow_synced_changes_not_unsynced_ones(engine):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    w = engine.upload_weight(rng.standard_normal((32, 64)).astype(np.float32))
    try:
        first = engine.matmul(a, w)
        raw = w.buffer.array(np.uint8)
        raw[: w.packed_bytes] = 0                   # CPU writes, not yet synced to the device
        assert _same_bits(engine.matmul(a, w), first), "an unsynced CPU write must stay invisible"
        w.buffer.sync_to_device(0, w.packed_bytes)
        assert not engine.matmul(a, w).any(), "a synced weight change must be seen"
    finally:
        w.free()


def _fp16_valued(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float16).astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(k32=st.integers(1, 96), n=st.integers(128, 5000), threads=st.integers(2, 4),
       seed=st.integers(0, 2**16))
@example(k32=45, n=322, threads=2, seed=0)   # OpenBLAS on 2 threads: one call's last 2 columns differ
def test_split_gemm_does_not_depend_on_the_thread_count(k32, n, threads, seed):
    rng = np.random.default_rng(seed)
    a, b = _fp16_valued(rng, (1, 32 * k32)), _fp16_valued(rng, (n, 32 * k32))
    task = _Fp16Task()
    results = []
    with pytest.MonkeyPatch.context() as mp:
        # split every GEMM of the sweep (the threshold is for speed, not for correctness)
        mp.setattr(sim_gemm, "SPLIT_MIN_WEIGHT_BYTES", 0)
        for gemm in (sim_gemm.Gemm(threads), sim_gemm.Gemm(1)):
            try:
                results.append(gemm(task, a, b))
            finally:
                gemm.close()
            assert gemm.split_calls == 1
    assert _same_bits(*results)
    assert _same_up_to_summation_order(results[0], sim_gemm.multiply(task, a, b), a, b, "fp16")


def test_decode_shape_splits_through_the_public_api_and_matches(engine):
    """Two of gemma3-270m's output projection tiles (K=640, N=16384: 42 MB of decoded
    weights, over ``sim_gemm.SPLIT_MIN_WEIGHT_BYTES`` once the tiles merge on the vendor ABI;
    rocket runs one tile per PC run, so nothing merges or splits there): the same bytes on
    two host threads as on one, within the summation bound of the per-task path."""
    rng = np.random.default_rng(5)
    a, b = _fp16_valued(rng, (1, 640)), _fp16_valued(rng, (16384, 640))
    sim = _model(engine)
    w = engine.upload_weight(b)
    default, two = sim.gemm, sim_gemm.Gemm(2)
    try:
        sim.gemm = two
        split = engine.matmul(a, w)
        assert (two.split_calls > 0) == (engine.device.kind == "rknpu")
        sim.gemm = sim_gemm.Gemm(1)
        assert _same_bits(split, engine.matmul(a, w))
        sim.gemm = two
        bulk, reference, _ = _both_paths(engine, a, b, "fp16", None)   # bulk=False: one call
        assert _same_bits(bulk, split) and _same_up_to_summation_order(reference, split, a, b, "fp16")
    finally:
        two.close()
        sim.gemm = default
        w.free()


# --- SimNpu directly, on the golden single-task stream ---------------------------------------
FEATURE, WEIGHTS, OUTPUT = 0x1000_0000, 0x2000_0000, 0x3000_0000


@pytest.fixture
def small_body(reference_dir):
    cases = json.loads((reference_dir / "golden" / "mtx512-single-task.json").read_text())["cases"]
    case = next(c for c in cases if (c["mode"], c["M"], c["K"], c["N"]) == ("fp16_fp32", 4, 32, 16))
    return [int(x, 16) for x in case["words"]][:-4]


def _memory(body: list[int], a: np.ndarray, b: np.ndarray) -> FakeMemory:
    mem = FakeMemory()
    mem.map(FEATURE, a.nbytes)[:] = pack_feature(a, 8).view(np.uint8)
    mem.map(WEIGHTS, b.nbytes)[:] = pack_weights(b, 16).view(np.uint8)
    mem.map(OUTPUT, a.shape[0] * b.shape[0] * 4)
    mem.map(REGCMD_ADDR, 1 << 12)
    words = np.array(body + task_tail(0, 0, 0x0D), dtype=np.uint64)
    mem.view(REGCMD_ADDR, words.nbytes)[:] = words.view(np.uint8)
    return mem


def _run(npu: SimNpu, body: list[int]) -> None:
    vendor_submit(npu, 0, REGCMD_ADDR, len(body), 1)


def _result(mem: FakeMemory) -> np.ndarray:
    return unpack_output(mem.view(OUTPUT, 4 * 16 * 4).view(np.float32), 4, 16, 4)


def test_replay_hits_the_decode_cache_and_rereads_untracked_memory(small_body):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 32)).astype(np.float16)
    b = rng.standard_normal((16, 32)).astype(np.float16)
    mem = _memory(small_body, a, b)
    npu = SimNpu(mem)
    _run(npu, small_body)
    first = _result(mem).copy()
    np.testing.assert_allclose(first, a.astype(np.float32) @ b.astype(np.float32).T, rtol=1e-6, atol=1e-6)
    b2 = -b                                        # test memory has no content tokens
    mem.view(WEIGHTS, b2.nbytes)[:] = pack_weights(b2, 16).view(np.uint8)
    _run(npu, small_body)
    assert npu.decoded.hits == 1 and npu.diagnostics(0) == []
    assert _same_bits(_result(mem), -first)


def test_a_refused_task_is_refused_the_same_way_every_time(small_body):
    body = list(small_body)
    cbuf = next(i for i, w in enumerate(body) if w and w & 0xFFFF == REGISTERS["CNA_CBUF_CON0"].offset)
    body[cbuf] = write_word("CNA_CBUF_CON0", 0x76)          # 7 weight + 6 data banks > 12
    rng = np.random.default_rng(4)
    mem = _memory(body, rng.standard_normal((4, 32)).astype(np.float16),
                  rng.standard_normal((16, 32)).astype(np.float16))
    npu = SimNpu(mem)
    diagnostics = []
    for _ in range(2):
        npu.soft_reset()
        _run(npu, body)
        diagnostics.append(npu.diagnostics(0))
    assert diagnostics[0] == diagnostics[1] and "cbuf-banks" in diagnostics[0][0]
    assert npu.decoded.hits == 0
