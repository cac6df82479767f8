"""No vendor SUBMIT the engine builds carries a core mask rknpu_job_commit does not commit (5 or
6): a property over matmul shapes, dtypes and core counts in the extended envelope, recorded
at the simulated kernel (docs/npu-programming.md "What the drivers really do")."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.engine.api import open_engine
from ggml_rknpu.kernel.rknpu import uapi as rk

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engines():
    made = {c: open_engine("sim-rknpu", cores=c, envelope="extended") for c in (2, 3)}
    masks: list[int] = []
    for npu in made.values():
        kernel = npu.device.syscalls
        real = kernel.ioctl

        def ioctl(fd: int, request: int, arg: bytearray, real=real) -> int:
            if request == rk.DRM_IOCTL_RKNPU_SUBMIT:
                masks.append(rk.rknpu_submit_v095.from_buffer_copy(bytes(arg)).core_mask)
            return real(fd, request, arg)

        kernel.ioctl = ioctl  # type: ignore[method-assign]
    yield made, masks
    for npu in made.values():
        npu.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cores=st.sampled_from([2, 3]), m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 200),
       dtype=st.sampled_from(["fp16", "int8"]))
def test_engine_submits_only_committed_core_masks(engines, cores, m, k, n, dtype):
    made, masks = engines
    npu = made[cores]
    rng = np.random.default_rng(m * 1000 + k)
    b = rng.standard_normal((n, k)).astype(np.float32)
    a = rng.standard_normal((m, k)).astype(np.float32)
    del masks[:]
    w = npu.upload_weight(b, dtype=dtype)
    try:
        npu.matmul(a, w)
    finally:
        w.free()
    assert masks and set(masks) <= set(rk.COMMITTED_CORE_MASKS), masks
