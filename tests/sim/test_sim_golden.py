"""The 15 hardware-validated single-task matmul streams (golden/mtx512-single-task.json)
run through SimNpu exactly as the vendor kernel submits them, on random data in the native
layouts, and give the numpy result: int8 exactly, fp16 within the documented model
(exact products, fp32 accumulation; fp16 output rounded to nearest even)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ggml_rknpu.sim.npu import SimNpu
from support.sim_support import (
    REGCMD_ADDR,
    FakeMemory,
    pack_feature,
    pack_weights,
    unpack_output,
    vendor_irq_fuzz,
    vendor_submit,
    within_fp16_model,
)

FEATURE, WEIGHTS, OUTPUT = 0x1000_0000, 0x2000_0000, 0x3000_0000
MODES = {  # mode -> (input dtype, output dtype, kernel group) [§6, §7]
    "fp16_fp32": (np.float16, np.float32, 16),
    "fp16_fp16": (np.float16, np.float16, 16),
    "int8_int32": (np.int8, np.int32, 32),
}
SLOW_WEIGHT_ELEMENTS = 20_000_000


def _cases(reference_dir):
    return json.loads((reference_dir / "golden" / "mtx512-single-task.json").read_text())["cases"]


# Case 14 is 1x8192x8192 fp16 (a 128 MiB weight set): slow.
CASES = [pytest.param(i, id=f"{m}-{i}", marks=[pytest.mark.slow] if i == 14 else [])
         for i, m in enumerate(["fp16_fp32"] * 6 + ["int8_int32"] * 5 + ["fp16_fp16"] * 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", CASES)
def test_golden_stream_executes_to_numpy(reference_dir, index):
    case = _cases(reference_dir)[index]
    m, k, n = case["M"], case["K"], case["N"]
    assert (k * n > SLOW_WEIGHT_ELEMENTS) == (index == 14)
    in_dt, out_dt, group = MODES[case["mode"]]
    assert int(case["feature_dma"], 16) == FEATURE and int(case["output_dma"], 16) == OUTPUT
    rng = np.random.default_rng(index)
    if in_dt is np.int8:
        a = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
        b = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    else:
        a = rng.standard_normal((m, k)).astype(np.float16)
        b = rng.standard_normal((n, k)).astype(np.float16)
    words = np.array([int(w, 16) for w in case["words"]], dtype=np.uint64)
    mem = FakeMemory()
    mem.map(REGCMD_ADDR, words.nbytes)[:] = words.view(np.uint8)
    mem.map(FEATURE, a.nbytes)[:] = pack_feature(a, 16 // a.itemsize).view(np.uint8)
    mem.map(WEIGHTS, b.nbytes)[:] = pack_weights(b, group).view(np.uint8)
    out = mem.map(OUTPUT, m * n * np.dtype(out_dt).itemsize)
    out[:] = 0xAB   # poison: every output byte must be written

    npu = SimNpu(mem)
    vendor_submit(npu, 0, REGCMD_ADDR, body_words=len(words) - 4, task_number=1)

    assert npu.diagnostics(0) == []
    status = npu.mmio_read(0, 0x28)
    assert status == 0x100, hex(status)                       # DPU group 0, task 0
    assert vendor_irq_fuzz(status) == 0x300                   # the kernel completes the job
    assert npu.mmio_read(0, 0x3C) == 1 and npu.executed_tasks(0) == 1
    conv = npu.trace(0)[0].conv
    assert conv is not None
    assert (conv.rows, conv.channels, conv.kernels) == (m, k, n)
    got = unpack_output(out.view(out_dt), m, n, 16 // np.dtype(out_dt).itemsize)
    if in_dt is np.int8:
        np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64).T)
        return
    ok = within_fp16_model(got, a, b)
    assert ok.all(), f"{int((~ok).sum())} outputs outside the fp16 model"
