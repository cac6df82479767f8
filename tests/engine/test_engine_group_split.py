"""Split K of decode rows over the weights as packed (``compiler.tiling.group_split``), run
on the simulator through the engine: the weight is packed once (its layout does not depend
on M), the M = 16 program reads parts of each kernel group's run, and its result is the
sum of the two halves' results bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import ggml_rknpu
from ggml_rknpu.compiler.tiling import k_chunks

pytestmark = pytest.mark.timeout(300)
K = 8192          # fp16 K in (6144, 8192]: one chunk, a kernel group fills 11 of 12 banks in PROVEN


@pytest.fixture(scope="module", params=("sim-rknpu", "sim-rocket"))
def npu(request):
    engine = ggml_rknpu.open(device=request.param, cores=1, envelope="proven")
    yield engine
    engine.close()


@pytest.mark.parametrize("N", [16, 48])
def test_m16_splits_k_and_equals_the_halves_summed(npu, N):
    rng = np.random.default_rng(N)
    b = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    a = rng.standard_normal((16, K)).astype(np.float32)
    w = npu.upload_weight(b)
    halves = [npu.upload_weight(np.ascontiguousarray(b[:, k0:k0 + K // 2])) for k0 in (0, K // 2)]
    try:
        got = npu.matmul(a, w)
        program = w.programs[(16, "fp32")].program
        assert len(k_chunks(K, "fp16", npu.envelope)) == 1            # one weight chunk, packed once
        assert program.k_splits == 2 and len(program.tasks) == 2 * N // 16
        parts = [npu.matmul(np.ascontiguousarray(a[:, k0:k0 + K // 2]), h) for k0, h in zip((0, K // 2), halves)]
        want = (parts[0] + parts[1]).astype(np.float32)
        if N == 16:   # same task shapes (16 rows, 16 kernels, 4096 channels): the same float sums
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
        ref = a.astype(np.float16).astype(np.float64) @ b.astype(np.float16).astype(np.float64).T
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        one = npu.matmul(a[:1], w)                                      # M = 1 on the same packed weight
        np.testing.assert_allclose(one, ref[:1], rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    finally:
        for x in (w, *halves):
            x.free()
