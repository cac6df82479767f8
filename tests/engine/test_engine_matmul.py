"""The engine end to end through the real submit path: NpuEngine -> compiler -> NpuDevice.submit
-> SimKernel -> SimNpu, on both ABIs.

Numerics checked:
* int8 x int8 -> int32: equal to numpy exactly.
* fp16 x fp16 -> fp32: the hardware model is fp16 inputs (RNE), exact products, at least
  fp32-wide accumulation [rknn-toolkit.md §1.5; npu-programming.md §10], in an order we do
  not assume; K chunks are summed on the host in fp32. For any fp32 summation order of K
  exact products the error is at most gamma_K * sum_k |a_k b_k| with gamma_K = K u / (1 - K u),
  u = 2^-24 [Higham, Accuracy and Stability of Numerical Algorithms, Thm 3.1/Lemma 3.1];
  the final fp32 rounding adds u |c|. The reference is the same products summed in float64.
  So: |c - ref| <= 1.01 * (K + 1) * 2^-24 * (|a16| @ |b16|^T) + tiny.
Large outputs are compared on a random sample of rows and columns (the NPU computes all).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.engine import NpuEngine, m_bucket, open_engine
from ggml_rknpu.kernel.errors import NpuFault, NpuTimeout

pytestmark = pytest.mark.timeout(600)
ABIS = ("sim-rknpu", "sim-rocket")
U32 = 2.0 ** -24


@pytest.fixture(scope="module", params=ABIS)
def npu(request):
    engine = open_engine(request.param)
    yield engine
    engine.close()


def _sample(n: int, rng, limit: int = 256) -> np.ndarray:
    return np.arange(n) if n <= limit else np.sort(rng.choice(n, limit, replace=False))


def check_matmul(npu: NpuEngine, M: int, K: int, N: int, dtype: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    if dtype == "int8":
        a = rng.integers(-128, 128, (M, K), dtype=np.int8)
        b = rng.integers(-128, 128, (N, K), dtype=np.int8)
    else:
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    w = npu.upload_weight(b, dtype=dtype)
    try:
        c = npu.matmul(a, w)
    finally:
        w.free()
    assert c.shape == (M, N)
    rows, cols = _sample(M, rng), _sample(N, rng)
    if dtype == "int8":
        assert c.dtype == np.int32
        ref = a[rows].astype(np.int64) @ b[cols].astype(np.int64).T
        np.testing.assert_array_equal(c[np.ix_(rows, cols)], ref)
        return
    assert c.dtype == np.float32
    a16 = a[rows].astype(np.float16).astype(np.float64)
    b16 = b[cols].astype(np.float16).astype(np.float64)
    ref = a16 @ b16.T
    bound = 1.01 * (K + 1) * U32 * (np.abs(a16) @ np.abs(b16).T) + 1e-30
    err = np.abs(c[np.ix_(rows, cols)] - ref)
    assert (err <= bound).all(), f"max err/bound {float((err / bound).max()):.3g} at {M}x{K}x{N}"


# --- a sweep of model shapes ------------------------------------------------------------
SWEEP_M = (1, 3, 64, 196, 513, 4096)
SWEEP_K = (32, 100, 1024, 4096, 8192, 11008)
SWEEP_N = (16, 1001, 4096, 32000, 151936)

# Fast subset: every value of every axis at least once, each dtype, unaligned K and N,
# sized for CI on a shared 2-core box (the simulator computes every output).
FAST = (
    (1, 4096, 4096), (3, 100, 1001), (64, 1024, 16), (196, 32, 1001), (513, 8192, 16),
    (4096, 32, 16), (1, 11008, 1001), (3, 32, 32000), (1, 100, 151936), (64, 1024, 4096),
    (196, 4096, 1001), (3, 11008, 4096), (513, 1024, 4096), (1, 8192, 4096), (4096, 100, 1001),
)


@pytest.mark.parametrize("dtype", ("fp16", "int8"))
@pytest.mark.parametrize("M,K,N", FAST, ids=lambda v: str(v))
def test_sweep_fast(npu, M, K, N, dtype):
    check_matmul(npu, M, K, N, dtype, seed=M + K + N)


# The full sweep leaves out the combinations whose weight exceeds 160 M elements (host
# memory on a shared box) or whose work exceeds 2e10 MACs (the simulator computes every
# output, so sampling rows/cols cannot shorten it), e.g. 4096 x 11008 x 151936 (6.9e12 MACs).
SLOW_MAX_WEIGHT = 160_000_000
SLOW_MAX_MACS = 20_000_000_000


def _slow_combos():
    for M, K, N in itertools.product(SWEEP_M, SWEEP_K, SWEEP_N):
        if (M, K, N) in FAST or K * N > SLOW_MAX_WEIGHT or M * K * N > SLOW_MAX_MACS:
            continue
        yield M, K, N


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ("fp16", "int8"))
@pytest.mark.parametrize("M,K,N", list(_slow_combos()), ids=lambda v: str(v))
def test_sweep_full(npu, M, K, N, dtype):
    check_matmul(npu, M, K, N, dtype, seed=M * 7 + K * 3 + N)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(1, 300), K=st.integers(1, 700), N=st.integers(1, 700),
       dtype=st.sampled_from(("fp16", "int8")), seed=st.integers(0, 2**16))
def test_random_shapes(npu, M, K, N, dtype, seed):
    check_matmul(npu, M, K, N, dtype, seed)


# --- the engine's promises ----------------------------------------------------------------
def test_int8_weight_with_float_activations_is_quantised_per_row(npu):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 96)).astype(np.float32)
    b = rng.standard_normal((40, 96)).astype(np.float32)
    w = npu.upload_weight(b, dtype="int8")
    c = npu.matmul(a, w)
    w.free()
    assert c.dtype == np.float32
    # two int8 roundings, each within half a step: |err| <= sum_k (|a||db| + |da||b| + |da||db|)
    da = np.abs(a).max(1, keepdims=True) / 254
    db = np.abs(b).max(1, keepdims=True) / 254
    bound = np.abs(a) @ db.repeat(96, 1).T + da.repeat(96, 1) @ np.abs(b).T + 96 * da @ db.T
    assert (np.abs(c - a @ b.T) <= bound * 1.001 + 1e-5).all()


def _warm_up(npu) -> None:
    """The device keeps a task buffer after its first submit; allocate it before measuring."""
    warm = npu.upload_weight(np.ones((16, 32), np.float32))
    npu.matmul(np.ones((1, 32), np.float32), warm)
    warm.free()


def test_program_cache_hit_on_repeat_and_weights_stay_resident(npu):
    _warm_up(npu)
    rng = np.random.default_rng(4)
    b = rng.standard_normal((48, 64)).astype(np.float32)
    w = npu.upload_weight(b)
    before = dict(npu.counters)
    free_after_upload = npu.memory_budget()[0]
    results = [npu.matmul(rng.standard_normal((m, 64)).astype(np.float32), w) for m in (3, 4, 3, 2, 3)]
    delta = {k: npu.counters[k] - before[k] for k in before}
    assert delta["weights_uploaded"] == 0 and delta["weight_bytes_uploaded"] == 0
    assert delta["programs_compiled"] == 2            # buckets 4 and 2
    assert delta["program_cache_hits"] == 3
    assert delta["submits"] == 5 and delta["matmuls"] == 5
    assert [r.shape for r in results] == [(3, 48), (4, 48), (3, 48), (2, 48), (3, 48)]
    npu.matmul(rng.standard_normal((3, 64)).astype(np.float32), w)
    assert npu.memory_budget()[0] == free_after_upload - _plan_bytes(npu, w)
    w.free()


def _plan_bytes(npu, w) -> int:
    """w's regcmd buffers, the vendor driver's task BO of each of their jobs (a page each) and
    the shared A/C buffers (w is the only weight with programs)."""
    task_bos = sum(len(p.jobs) for p in w.programs.values()) * 4096 if npu.abi == "rknpu" else 0
    return sum(p.regcmd_buf.capacity for p in w.programs.values()) + task_bos + npu.scratch_bytes()


def test_free_returns_memory(npu):
    _warm_up(npu)
    free0 = npu.memory_budget()[0]
    w = npu.upload_weight(np.ones((256, 1024), np.float32))
    npu.matmul(np.ones((2, 1024), np.float32), w)
    assert npu.memory_budget()[0] < free0
    w.free()
    assert npu.memory_budget()[0] == free0
    with pytest.raises(ValueError, match="freed"):
        npu.matmul(np.ones((2, 1024), np.float32), w)


def test_last_timing_is_measured_on_host_and_modeled_on_device(npu):
    w = npu.upload_weight(np.ones((32, 64), np.float32))
    npu.matmul(np.ones((8, 64), np.float32), w)
    t = npu.last_timing
    w.free()
    assert t.device_label == "modeled" and t.device_s > 0 and t.submits == 1
    assert min(t.pack_s, t.submit_s, t.unpack_s) >= 0 and t.host_s > 0


def test_large_m_runs_as_several_submits(npu):
    rng = np.random.default_rng(5)
    a = rng.integers(-128, 128, (4100, 32), dtype=np.int8)
    b = rng.integers(-128, 128, (20, 32), dtype=np.int8)
    w = npu.upload_weight(b, dtype="int8")
    c = npu.matmul(a, w)
    w.free()
    assert npu.last_timing.submits >= 3
    np.testing.assert_array_equal(c, a.astype(np.int32) @ b.astype(np.int32).T)


@pytest.mark.parametrize("m, bucket", [(1, 1), (3, 4), (64, 64), (196, 256), (257, 512), (513, 768), (2048, 2048)])
def test_m_buckets(m, bucket):
    assert m_bucket(m) == bucket


# --- clear errors, nothing lost -----------------------------------------------------------
def test_shape_mismatch(npu):
    w = npu.upload_weight(np.ones((8, 64), np.float32))
    with pytest.raises(ValueError, match="shape mismatch.*K=64"):
        npu.matmul(np.ones((2, 65), np.float32), w)
    w.free()


def test_dtype_mismatch(npu):
    w = npu.upload_weight(np.ones((8, 64), np.int8), dtype="int8")
    with pytest.raises(TypeError, match="int8 or float"):
        npu.matmul(np.ones((2, 64), np.int16), w)
    with pytest.raises(ValueError, match="out='fp16'"):
        npu.matmul(np.ones((2, 64), np.int8), w, out="fp16")
    w.free()
    with pytest.raises(ValueError, match="dtype must be one of"):
        npu.upload_weight(np.ones((8, 64), np.float32), dtype="int4")


def test_weight_from_another_engine_is_refused(npu):
    with pytest.raises(TypeError, match="upload_weight"):
        npu.matmul(np.ones((2, 2), np.float32), object())


def test_timeout_is_reported_and_the_engine_survives(npu):
    w = npu.upload_weight(np.ones((16, 32), np.float32))
    a = np.ones((4, 32), np.float32)
    np.testing.assert_array_equal(npu.matmul(a, w), np.full((4, 16), 32, np.float32))
    bound = next(iter(w.programs.values()))
    words = bound.regcmd_buf.array(np.uint64)
    saved = words.copy()
    words[:] = 0                                     # no op-enable, no tail: the NPU never finishes
    bound.regcmd_buf.sync_to_device()
    # vendor: the driver times out; mainline rocket returns stale output with no error, which
    # the engine's canaries turn into an NPU fault
    expected = (NpuTimeout, "timed out") if npu.device.kind == "rknpu" else (NpuFault, "canar")
    with pytest.raises(expected[0], match=expected[1]):
        npu.matmul(a, w)
    words[:] = saved
    bound.regcmd_buf.sync_to_device()
    np.testing.assert_array_equal(npu.matmul(a, w), np.full((4, 16), 32, np.float32))
    w.free()


def test_out_of_npu_memory_is_clear_and_loses_nothing():
    """A device whose memory runs out: cached programs are evicted first; when nothing is
    left to evict the error says how much was asked and what to do, and the engine (and the
    weights already resident) keep working."""
    from ggml_rknpu.kernel.device import NpuDevice
    from ggml_rknpu.kernel.errors import NpuOutOfMemory
    from ggml_rknpu.sim.kernel import SimKernel

    sim = SimKernel("rknpu", memory_limit=4 << 20)
    path = sim._device_paths()[-1]
    npu = NpuEngine(NpuDevice(sim, sim.open(path), path, simulated=True))
    w1 = npu.upload_weight(np.ones((512, 1024), np.float32))           # 1 MiB
    np.testing.assert_array_equal(npu.matmul(np.ones((256, 1024), np.float32), w1), 1024)
    w2 = npu.upload_weight(np.ones((1024, 1024), np.float32))          # 2 MiB: evicts w1's program
    assert npu.counters["programs_evicted"] >= 1 and not w1.programs
    with pytest.raises(NpuOutOfMemory, match="out of NPU memory.*free weights"):
        npu.upload_weight(np.ones((1024, 1024), np.float32))
    np.testing.assert_array_equal(npu.matmul(np.ones((2, 1024), np.float32), w1), 1024)
    w2.free()
    np.testing.assert_array_equal(npu.matmul(np.ones((2, 1024), np.float32), w1), 1024)
    npu.close()


def test_fp16_output_adds_one_rounding(npu):
    """out="fp16": the fp32 bound plus one fp16 rounding of the result (2^-11 relative;
    the NPU writes fp16 via FP32TOFP16 [npu-programming.md §7 OUT_CVT_SCALE])."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((7, 200)).astype(np.float32)
    b = (rng.standard_normal((40, 200)) / 14).astype(np.float32)
    w = npu.upload_weight(b)
    c = npu.matmul(a, w, out="fp16")
    w.free()
    assert c.dtype == np.float16
    a16, b16 = a.astype(np.float16).astype(np.float64), b.astype(np.float16).astype(np.float64)
    ref = a16 @ b16.T
    bound = 1.01 * 201 * U32 * (np.abs(a16) @ np.abs(b16).T) + 2.0**-11 * np.abs(ref) + 2.0**-24
    assert (np.abs(c.astype(np.float64) - ref) <= bound).all()


@pytest.mark.parametrize("cores", (1, 2))
def test_fewer_cores(cores):
    with open_engine("sim-rknpu", cores=cores) as engine:
        check_matmul(engine, 70, 300, 1001, "int8", seed=cores)
        check_matmul(engine, 5, 2000, 100, "fp16", seed=cores)
    with pytest.raises(ValueError, match="cores must be in 1..3"):
        open_engine("sim-rknpu", cores=4)


def test_bucket_refused_by_the_compiler_splits_the_call(monkeypatch):
    """Real compiler and device; the compiler is made to refuse buckets above 64 rows as it
    refuses programs of more than 4095 tasks per core (too big to build here)."""
    from ggml_rknpu.engine.programs import ProgramCache

    real = ProgramCache.compile

    def refusing(self, m, *args):
        if m > 64:
            raise ValueError(f"matmul needs more than 4095 tasks on core 0 (M={m}); split the call along M")
        return real(self, m, *args)

    monkeypatch.setattr(ProgramCache, "compile", refusing)
    rng = np.random.default_rng(12)
    a = rng.integers(-128, 128, (300, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (24, 64), dtype=np.int8)
    with open_engine("sim-rknpu") as engine:
        w = engine.upload_weight(b, dtype="int8")
        np.testing.assert_array_equal(engine.matmul(a, w), a.astype(np.int32) @ b.astype(np.int32).T)
        assert engine.last_timing is not None
        assert w.max_program_m == 64 and engine.last_timing.submits == 5
        assert "split the call along M" in w.compile_errors[0]
